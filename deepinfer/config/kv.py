"""The KV description: what one token's cached state is, per layer, and how blocks of it are laid out.

Every place that allocates, sizes, checks, names, stores or sends KV reads a `KvSpec` — the engine's
pool, the P/D transfer, the cache daemon's tiers, the block-hash namespace, the draft pool — so a new
attention form (MLA's latent) or a new KV dtype is a change of this object, not of its readers.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deepinfer.config.model import ModelConfig

# Wire name → bytes per value; the torch dtype of the same name holds the values. The name is what the
# hash namespace and error messages carry. torch is imported only by the methods that make or read tensors:
# a service that only names KV (the tokenizer, which hashes prompts in its namespace) never loads it.
KV_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
# The engine's default KV dtype, and the ones its attention reads (kernels.paged_attention and the
# torch paths): K/V are stored in the spec's dtype and widened to fp32 as they are read; all attention
# arithmetic is fp32. bfloat16 is a wire name only: a spec may describe it, the engine refuses it.
ENGINE_KV_DTYPE = "float32"
ENGINE_KV_DTYPES = ("float32", "float16")
_SEPARATORS = ",="  # the layout string's separators: no dimension or axis name may contain them


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype the KV may have; ValueError for any other."""
    name = _name(dtype)
    if name in KV_DTYPES:
        return name
    raise ValueError(f"{dtype} is not a KV dtype (one of {', '.join(KV_DTYPES)})")


@dataclass(frozen=True)
class KvSpec:
    """One model's KV cache as data: dtype, per-layer per-token components, block layout, sizes.

    Contract:
    * Per layer and token the cache holds `len(components)` vectors ("components": K and V for
      Llama-family attention; MLA holds one, the compressed latent concatenated with the rope key),
      each shaped `token_shape` (the sizes of `token_dims`, named for the layout string).
    * `dtype_name` is one of `KV_DTYPES`; the engine serves `ENGINE_KV_DTYPES` (fp16 halves every
      size below against fp32) and widens K/V to fp32 to attend.
    * A block is one contiguous tensor `block_shape` = [layers, components, block_size, *token_shape]
      of `dtype`: every layer's KV for `block_size` consecutive tokens. It is the unit the device pool
      indexes (dim 0 of the pool [num_blocks, *block_shape]), the cache daemon stores (`block_nbytes`
      bytes per payload) and the P/D transfer and cache replies move ([n, *block_shape]).
    * `layout` names and sizes the block's dimensions ("layers=L,kv=2,block_size=B,kv_heads=H,
      head_dim=D"); with `dtype_name` it is what the block-hash namespace and KvTransfer carry, so two
      processes that agree on both can exchange blocks byte for byte. The string for a given spec
      never changes: on-disk caches are keyed by it.
    * Component c of layer l in a pool is `pool[:, l, c]`, [num_blocks, block_size, *token_shape],
      strided in dim 0 — the view attention kernels read and write.
    """

    num_layers: int
    block_size: int
    components: tuple[str, ...]  # per layer and token, e.g. ("k", "v"); MLA: ("latent",)
    token_dims: tuple[tuple[str, int], ...]  # each component's (dimension name, size), outermost first
    dtype_name: str = ENGINE_KV_DTYPE
    component_axis: str = "kv"  # the layout string's name for the components dimension

    def __post_init__(self) -> None:
        if self.dtype_name not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.dtype_name!r}; expected one of {', '.join(KV_DTYPES)}")
        sizes = [self.num_layers, self.block_size, len(self.components), *self.token_shape]
        if not self.token_dims or any(not isinstance(s, int) or s <= 0 for s in sizes):
            raise ValueError(f"a KV spec needs positive sizes, got layers={self.num_layers}, block_size="
                             f"{self.block_size}, components={self.components}, token_dims={self.token_dims}")
        names = [self.component_axis, *self.components, *(n for n, _ in self.token_dims)]
        if any(not n or any(s in n for s in _SEPARATORS) for n in names):
            raise ValueError(f"KV dimension names must be non-empty and free of {_SEPARATORS!r}: {names}")

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype_name: str = ENGINE_KV_DTYPE) -> KvSpec:
        """The spec of `config`'s attention:

        * Llama-family (dense, Mixtral, Qwen2-MoE): K and V, each [kv_heads, head_dim]; layout
          "layers=L,kv=2,block_size=B,kv_heads=H,head_dim=D".
        * Multi-head latent attention (DeepSeek-V2/V3, `config.mla`): one component, "latent", of
          [kv_lora_rank + qk_rope_head_dim] floats — the RMS-normed compressed latent, then the roped
          key every head shares; layout "layers=L,kv=1,block_size=B,latent_dim=C+R".
        """
        if config.mla is not None:
            return cls(config.num_layers, block_size, ("latent",), (("latent_dim", config.mla.latent_dim),),
                       dtype_name)
        return cls(config.num_layers, block_size, ("k", "v"),
                   (("kv_heads", config.num_kv_heads), ("head_dim", config.head_dim)), dtype_name)

    # -- shapes and sizes ----------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def token_shape(self) -> tuple[int, ...]:
        """One component's shape for one token in one layer."""
        return tuple(size for _, size in self.token_dims)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, len(self.components), self.block_size, *self.token_shape)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    @property
    def bytes_per_token(self) -> int:
        """Every layer's KV for one token."""
        return self.num_layers * len(self.components) * math.prod(self.token_shape) * KV_DTYPES[self.dtype_name]

    @property
    def block_nbytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def layout(self) -> str:
        """One block's dimensions, named and sized, outermost first (see the class contract)."""
        dims = [("layers", self.num_layers), (self.component_axis, len(self.components)),
                ("block_size", self.block_size), *self.token_dims]
        return ",".join(f"{name}={size}" for name, size in dims)

    @property
    def dim_names(self) -> str:
        """The names of a block batch's dimensions, for error messages: "blocks, layers, kv, ..."."""
        return ", ".join(["blocks", "layers", self.component_axis, "block_size", *(n for n, _ in self.token_dims)])

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks fit in `budget_bytes`; ValueError when not even one does."""
        n = budget_bytes // self.block_nbytes
        if n < 1:
            raise ValueError(f"kv_cache_bytes={budget_bytes} is smaller than one KV block ({self.block_nbytes} bytes)")
        return int(n)

    # -- tensors -------------------------------------------------------------------------------------

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled pool [num_blocks, *block_shape]. Zeros, not empty: the torch decode fallback
        multiplies masked (beyond-context) slots by zero weights, and 0 * NaN would poison the row.
        On the CPU the pool is in huge pages (huge_pages.py): decode reads every live row each step,
        and with 4 KiB pages one layer's rows of a block already span several pages. Its pages are
        faulted in here, at startup, not by the first step that reaches a block (see huge_page_zeros)."""
        import torch

        from deepinfer.kernels.huge_pages import huge_page_zeros

        if torch.device(device).type == "cpu":
            return huge_page_zeros(self.pool_shape(num_blocks), self.dtype, prefault=True)
        return torch.zeros(self.pool_shape(num_blocks), dtype=self.dtype, device=device)

    def layer_views(self, pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s components in a pool, each [num_blocks, block_size, *token_shape] (strided in dim 0)."""
        return tuple(pool[:, layer, c] for c in range(len(self.components)))

    def problem(self, t: object, num_blocks: int | None = None) -> str | None:
        """Why `t` is not a batch of this spec's blocks ([num_blocks, *block_shape], any count when
        None) — a message naming what was expected — or None when it is one."""
        import torch

        if not isinstance(t, torch.Tensor):
            return f"kv must be a torch.Tensor, got {type(t).__name__}"
        n = t.shape[0] if num_blocks is None and t.dim() > 0 else num_blocks
        want = (n, *self.block_shape)
        if t.dtype != self.dtype or tuple(t.shape) != want:
            return f"kv is {_name(t.dtype)} {tuple(t.shape)}; expected {self.dtype_name} {want} [{self.dim_names}]"
        return None

    def block_problem(self, t: object) -> str | None:
        """Why `t` is not one block (block_shape, dtype), or None."""
        import torch

        if isinstance(t, torch.Tensor) and t.dtype == self.dtype and tuple(t.shape) == self.block_shape:
            return None
        got = f"{_name(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        return f"a block is {got}; expected {self.dtype_name} {self.block_shape} [{self.dim_names[len('blocks, '):]}]"

    def check(self, t: object, num_blocks: int | None = None) -> torch.Tensor:
        """`t` itself when it is a batch of blocks (see `problem`); ValueError with the reason when not."""
        reason = self.problem(t, num_blocks)
        if reason is not None:
            raise ValueError(reason)
        return t  # type: ignore[return-value]  # `problem` checked it is a tensor

    def view_block(self, buffer: bytes | bytearray | memoryview) -> torch.Tensor:
        """One block over a wire or store buffer of exactly `block_nbytes` bytes (no copy; the tensor
        aliases the buffer, which must outlive it, and a read-only buffer's tensor must only be read)."""
        import torch

        if memoryview(buffer).nbytes != self.block_nbytes:
            raise ValueError(f"a block buffer has {memoryview(buffer).nbytes} bytes; expected {self.block_nbytes}")
        with warnings.catch_warnings():  # frombuffer warns about read-only memory: see above
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buffer, dtype=self.dtype).view(self.block_shape)

    def block_payloads(self, blocks: torch.Tensor) -> list[bytes]:
        """Each block of a checked batch as `block_nbytes` bytes (copies, in the tensor's native byte order)."""
        import torch

        raw = memoryview(blocks.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")
        nb = self.block_nbytes
        return [bytes(raw[i * nb:(i + 1) * nb]) for i in range(blocks.shape[0])]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
