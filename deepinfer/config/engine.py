"""The knobs of one engine instance (`EngineConfig`) and the one definition of every engine default.

The `DEFAULT_*` constants are the one definition of each engine default: EngineConfig, the launcher's
topology and command line, and the services' constructors all take them from here, so no two layers can
disagree (the block size above all: it is part of the KV-cache namespace, and services that hash blocks
differently refuse each other at the handshake). `EngineConfig` is frozen: one value is built at the edge
(the command line, a topology file, a test) and passed whole; `dataclasses.replace` makes a variant.

The `--speculative` grammar (`parse_speculative`) lives here too, so a bad method is refused when the
config is built, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.model import ConfigError

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_KV_CACHE_MB = 512  # a worker's device KV pool
DEFAULT_SWAP_SPACE_MB = 256  # host memory a worker may copy preempted requests' KV into (engine/preemption.py)
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_DEVICE = "cpu"
# An expert-parallel group: how long a rank waits for the rendezvous and for any control-channel operation
# before it declares the group broken (a rank that died is noticed at once; this bounds a hung one).
DEFAULT_EP_TIMEOUT_S = 300.0
# How projection weights are held (EngineConfig.weights): "native" keeps a GGUF file's Q8_0/Q4_0/Q4_1
# blocks packed and multiplies from them (deepinfer.kernels.quant_linear); "fp32" dequantises every
# tensor at load; "q8_0" quantises a checkpoint's fp32/fp16/bf16 projections to Q8_0 blocks at load;
# "auto" is "native" for a GGUF file on a CPU device and "fp32" otherwise.
WEIGHTS_MODES = ("auto", "native", "fp32", "q8_0")
DEFAULT_WEIGHTS = "auto"
# The KV cache's element type (EngineConfig.kv_cache_dtype, KvSpec.dtype_name): fp32, or fp16 (half
# the bytes in the pool, the cache tiers and on the wire; attention still computes in fp32).
# The command line's short names map to these.
KV_CACHE_DTYPES = {"fp32": "float32", "fp16": "float16"}
DEFAULT_KV_CACHE_DTYPE = "float32"
MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS = 1, 32  # bounds of num_speculative_tokens


def kv_cache_dtype_name(value: str) -> str:
    """The KvSpec dtype name of a KV cache dtype given as "fp32"/"fp16" or "float32"/"float16"."""
    name = KV_CACHE_DTYPES.get(value, value)
    if name not in KV_CACHE_DTYPES.values():
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    return name



# The `--speculative` grammar: a method is a kind, then the argument that kind takes after a colon —
# none (""), a positive layer count ("L", as in self:8), a path ("PATH", as in draft:/models/small) or,
# optionally, draft trees ("tree", as in ngram:tree or ngram:tree=8: up to that many leaves, DEFAULT_TREE_LEAVES
# without a count; speculative/tree.py).
# This layer knows only the grammar; the guesser each kind builds is registered with the engine
# (deepinfer.engine.speculative.registry), which refuses a kind with none, and a test keeps the two sets equal.
NO_ARGUMENT, LAYERS, PATH, TREE = "", "L", "PATH", "tree"
KINDS: dict[str, str] = {"ngram": TREE, "suffix": TREE, "self": LAYERS, "draft": PATH}
DEFAULT_TREE_LEAVES, MAX_TREE_LEAVES = 4, 16


def speculative_methods() -> str:
    """The methods the grammar accepts, for messages and help: "ngram[:tree[=N]], ..., self:L or draft:PATH"."""
    forms = [f"{kind}[:tree[=N]]" if arg == TREE else f"{kind}:{arg}" if arg else kind for kind, arg in KINDS.items()]
    return f"{', '.join(forms[:-1])} or {forms[-1]}" if len(forms) > 1 else forms[0]


@dataclass(frozen=True)
class SpeculativeSpec:
    """A parsed `--speculative` value: a kind of `KINDS` and its argument, if the kind takes one."""

    kind: str
    num_layers: int | None = None  # a LAYERS kind's count (self:L)
    path: str | None = None  # a PATH kind's path (draft:PATH)
    tree_leaves: int = 1  # a TREE kind's most leaves per draft tree (1: chains)

    def __str__(self) -> str:
        if self.tree_leaves > 1:
            return f"{self.kind}:tree={self.tree_leaves}"
        if KINDS.get(self.kind) == LAYERS:
            return f"{self.kind}:{self.num_layers}"
        if KINDS.get(self.kind) == PATH:
            return f"{self.kind}:{self.path}"
        return self.kind


def parse_speculative(text: str) -> SpeculativeSpec:
    """Parse a `--speculative` value per `KINDS`; ConfigError names what is wrong."""
    kind, _, arg = str(text).partition(":")
    if kind not in KINDS:
        raise ConfigError(f"unknown speculative method {text!r}; expected {speculative_methods()}")
    if KINDS[kind] == TREE and arg:
        word, eq, count = arg.partition("=")
        if word != "tree" or (eq and not (count.isdigit() and 2 <= int(count) <= MAX_TREE_LEAVES)):
            raise ConfigError(f"{kind} takes no argument or tree[=N], N in [2, {MAX_TREE_LEAVES}] leaves "
                              f"(got {text!r})")
        return SpeculativeSpec(kind, tree_leaves=int(count) if eq else DEFAULT_TREE_LEAVES)
    if KINDS[kind] in (NO_ARGUMENT, TREE):
        if arg:
            raise ConfigError(f"speculative method {kind!r} takes no argument (got {text!r})")
        return SpeculativeSpec(kind)
    if KINDS[kind] == LAYERS:
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(f"{kind}-draft needs a positive layer count, as in {kind}:8 (got {text!r})")
        return SpeculativeSpec(kind, num_layers=int(arg))
    if not arg:
        raise ConfigError(f"a {kind} model needs a path, as in {kind}:/models/small (got {text!r})")
    return SpeculativeSpec(kind, path=arg)



@dataclass(frozen=True)
class EngineConfig:
    """The knobs of one engine instance: built once at the edge, then passed whole (frozen)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    # Bytes of KV cache to preallocate; `num_kv_blocks` overrides it when set.
    kv_cache_bytes: int = DEFAULT_KV_CACHE_MB * 1024 * 1024
    num_kv_blocks: int | None = None
    # Host memory for preempted requests' KV, swapped out where that is cheaper than recomputing it; 0: recompute.
    # A bound, not a reservation: copies are allocated while requests are swapped out and freed as they come back.
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_MB * 1024 * 1024
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Context limit; None means the model's max_position_embeddings.
    max_model_len: int | None = None
    device: str = DEFAULT_DEVICE
    num_threads: int | None = None
    # Use the compiled paged-attention kernel for decode rows when it builds; the torch path otherwise.
    use_native_kernels: bool = True
    # Let a step of decode rows run every layer in one native call (kernels/decode_layers.py) where the model
    # and its weights allow; False keeps every step per op (for comparisons: the outputs are the same bits).
    decode_loop: bool = True
    # Let the kernels take their AMX-BF16 tile paths (prefill attention, products of many rows) where the CPU
    # has them; False keeps every call off the tiles (for A/B runs, or a CPU whose tile path misbehaves). The
    # switch is process-wide (kernels/amx.py: the kernels are loaded once per process), set when the engine is
    # built; the launcher's DEEPINFER_AMX=0 sets this field to False.
    amx: bool = True
    # Keep freed full blocks addressable by their hash so later prompts with the same prefix reuse them.
    enable_prefix_caching: bool = True
    # Speculative decoding: None (off), "ngram", "suffix", "self:L" (the model's first L layers as the
    # draft) or "draft:PATH" (a smaller model sharing the tokenizer). See deepinfer.engine.speculative.
    speculative: str | None = None
    # The most tokens proposed for one request in one step.
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # Let the controller choose each request's k per step (0 = off) from measured costs and acceptance;
    # False: always propose up to num_speculative_tokens.
    adaptive_speculation: bool = True
    # n-gram matching: the shortest and longest suffix of a request's tokens looked up.
    ngram_min: int = 1
    ngram_max: int = 4
    # Expert parallelism: extra replicas per MoE layer in the static placement the engine starts with
    # when none is given (ExpertPlacement.static's `redundant`; a balancer later moves them to the hot
    # experts). None: max(1, num_experts // 8), capped at num_experts · (ranks - 1); 0: one copy of each
    # expert. More than the group can hold (num_experts · (ranks - 1)) is refused when the engine starts.
    redundant_experts: int | None = None
    # Expert parallelism: the group's rendezvous and control-channel timeout (DEFAULT_EP_TIMEOUT_S).
    ep_timeout_s: float = DEFAULT_EP_TIMEOUT_S
    # Weights: one of WEIGHTS_MODES (see there).
    weights: str = DEFAULT_WEIGHTS
    # KV element type: "float32" or "float16" ("fp32"/"fp16" are accepted and stored as those names).
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS_MODES:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {self.weights!r}")
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))  # the canonical name
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.swap_space_bytes < 0:
            raise ConfigError(f"swap_space_bytes must not be negative, got {self.swap_space_bytes}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be positive")
        if not MIN_SPECULATIVE_TOKENS <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max")
        if self.redundant_experts is not None and self.redundant_experts < 0:
            raise ConfigError(f"redundant_experts must not be negative, got {self.redundant_experts}")
        if self.speculative is not None:
            parse_speculative(self.speculative)  # raises ConfigError naming what is wrong
