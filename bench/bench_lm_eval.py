"""lm-evaluation-harness as a real client of the HTTP gateway: a local multiple-choice task, scored over HTTP.

    python -m bench.bench_lm_eval                          # starts a mesh + gateway on SmolLM2, runs the task
    python -m bench.bench_lm_eval --reference              # also the same task on transformers (same weights)
    python -m bench.bench_lm_eval --url http://127.0.0.1:8000 --limit 20

What runs: `lm_eval.simple_evaluate` with lm-evaluation-harness's own `local-completions` model pointed at the
gateway's `POST /v1/completions` (`base_url=<url>/v1/completions`), on the task `deepinfer_basics`
(`bench/data/lm_eval/`: 60 four-way multiple-choice questions written for this repository, scored by the
log-likelihood of each answer). For each (question, answer) pair the harness sends the tokens of context +
answer as a token-id prompt (`tokenized_requests=True`, tokenized on the client by the SmolLM2 tokenizer, which
this script writes as a Hugging Face tokenizer directory from the GGUF) with `echo: true, logprobs: 1,
max_tokens: 1` and sums the returned `token_logprobs` over the answer's tokens — so the gateway's echo + prompt
logprobs path is what is measured. `num_concurrent` requests in flight (`--num-concurrent`), batch size 1.
Nothing reaches a hub: `HF_HUB_OFFLINE=1`, `HF_DATASETS_OFFLINE=1`; the dataset is read by `datasets`' packaged
`json` builder from the local file.

`--reference` also runs the same task, same tokenization, on a transformers `LlamaForCausalLM` holding the same
fp32 weights (`tests.engine.oracle.hf_model_from_loaded`) in this process (a small lm_eval model class here: lm_eval's
`hf` model needs `accelerate`): the scores should agree (log-likelihoods differ only by float summation order, so a
flipped answer is possible but rare).

Writes `bench/results/lm_eval.json` (`--out`): the harness's metrics (acc, acc_norm and their stderr), the
number of samples, the wall time of the evaluation (mesh start and model load excluded), versions and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "bench" / "data" / "lm_eval"
TASK = "deepinfer_basics"


def write_tokenizer_dir(out: Path) -> Path:
    """SmolLM2's tokenizer as a Hugging Face directory (tokenizer.json, tokenizer_config.json, ...), made from
    the GGUF the mesh serves: the harness tokenizes with exactly the server's vocabulary."""
    from deepinfer.loading.derive_moe import tokenizer_files
    from deepinfer.loading.fetch import fetch_smollm2

    out.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(fetch_smollm2(progress=False), 2048).items():
        (out / name).write_text(text)
    return out


def write_task_dir(out: Path) -> Path:
    """The task's YAML with its data file as an absolute path (so the run does not depend on the cwd)."""
    out.mkdir(parents=True, exist_ok=True)
    text = (TASK_DIR / f"{TASK}.yaml").read_text()
    rel = f"bench/data/lm_eval/{TASK}.jsonl"
    if rel not in text:
        raise RuntimeError(f"{TASK}.yaml does not name {rel}")
    (out / f"{TASK}.yaml").write_text(text.replace(rel, str(TASK_DIR / f"{TASK}.jsonl")))
    return out


def evaluate(model: str, model_args: dict[str, Any] | str | Any, task_dir: Path, limit: int | None) -> dict[str, Any]:
    """One `simple_evaluate` of the task; the task's metrics, sample count and wall seconds."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    kwargs: dict[str, Any] = {"model": model, "tasks": [TASK], "task_manager": TaskManager(include_path=str(task_dir)),
                              "batch_size": 1, "limit": limit, "log_samples": True}
    if isinstance(model_args, dict | str):
        kwargs["model_args"] = model_args
    else:  # an lm_eval model instance
        kwargs["model"] = model_args
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(**kwargs)
    wall = time.perf_counter() - start
    metrics = {k.replace(",none", ""): v for k, v in out["results"][TASK].items() if k != "alias"}
    samples = out.get("n-samples", {}).get(TASK) or {}
    # Per question (by doc id): the log-likelihood of each answer, as the harness received it.
    lls = {x["doc_id"]: [float(r[0][0]) for r in x["resps"]] for x in out.get("samples", {}).get(TASK, [])}
    return {"metrics": metrics, "samples": samples.get("effective", samples), "wall_s": wall,
            "loglikelihoods": [lls[k] for k in sorted(lls)]}


def http_model_args(url: str, model: str, tokenizer: Path, concurrent: int) -> dict[str, Any]:
    return {"base_url": url.rstrip("/") + "/v1/completions", "model": model, "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": concurrent,
            "max_retries": 1, "max_length": 2048, "timeout": 600}


def reference_model(tokenizer: Path) -> Any:
    """An lm_eval model scoring with transformers' Llama holding the GGUF's weights dequantised to fp32, with the
    tokenization `local-completions` uses (the same HF tokenizer, no special tokens added), one sequence per
    forward. (lm_eval's own `hf` model needs `accelerate`, which the project does not install.)"""
    sys.path.insert(0, str(ROOT))
    import torch
    from lm_eval.api.model import TemplateLM
    from transformers import AutoTokenizer

    from deepinfer.loading.fetch import fetch_smollm2
    from deepinfer.loading.weights import load_model_weights
    from tests.engine.oracle import hf_model_from_loaded

    torch.set_num_threads(1)  # short sequences: one thread is enough, and shares a busy machine best
    loaded = load_model_weights(fetch_smollm2(progress=False))
    hf = hf_model_from_loaded(loaded.config, loaded.state_dict)
    tok = AutoTokenizer.from_pretrained(str(tokenizer))

    class TransformersReference(TemplateLM):  # type: ignore[misc]
        @property
        def eot_token_id(self) -> int:
            return int(tok.eos_token_id)

        def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
            return list(tok(string, add_special_tokens=False).input_ids)

        def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
            out = []
            with torch.inference_mode():
                for _, ctx, cont in requests:
                    ids = torch.tensor([ctx + cont])
                    logp = torch.log_softmax(hf(ids).logits[0, len(ctx) - 1:-1].float(), dim=-1)
                    target = torch.tensor(cont)
                    picked = logp[torch.arange(len(cont)), target]
                    out.append((float(picked.sum()), bool((logp.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            raise NotImplementedError("the reference only scores multiple-choice tasks")

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            raise NotImplementedError("the reference only scores multiple-choice tasks")

    return TransformersReference()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (otherwise a mesh with one is started)")
    ap.add_argument("--model", default="smollm2", help="what the started mesh serves")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--disaggregated", action="store_true")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--launch-arg", action="append", default=[])
    ap.add_argument("--num-concurrent", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions")
    ap.add_argument("--reference", action="store_true", help="also score the task with transformers")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lm_eval.json")
    args = ap.parse_args(argv)
    command = "python -m bench.bench_lm_eval " + " ".join(sys.argv[1:] if argv is None else argv)

    import lm_eval

    from bench.bench_serving import LaunchedMesh, served_model

    report: dict[str, Any] = {"command": command, "task": TASK, "task_file": str(TASK_DIR / f"{TASK}.jsonl"),
                              "lm_eval": getattr(lm_eval, "__version__", "?"), "python": platform.python_version(),
                              "loadavg_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-lm-eval-") as tmp:
        tokenizer = write_tokenizer_dir(Path(tmp) / "tokenizer")
        task_dir = write_task_dir(Path(tmp) / "tasks")
        mesh = None
        try:
            if args.url:
                url = args.url
            else:
                ns = argparse.Namespace(port=args.port, model=args.model, kv_cache_mb=args.kv_cache_mb,
                                        disaggregated=args.disaggregated, threads=args.threads,
                                        launch_arg=args.launch_arg)
                mesh = LaunchedMesh(ns)
                print(f"starting: {mesh.command}", flush=True)
                mesh.wait_ready(timeout_s=900)
                url = mesh.url
                report["launch"] = mesh.command
            served = served_model(url, args.model)
            model_args = http_model_args(url, served, tokenizer, args.num_concurrent)
            report["http"] = evaluate("local-completions", model_args, task_dir, args.limit) | {
                "model_args": model_args}
        finally:
            if mesh is not None:
                mesh.stop()
        if args.reference:
            report["transformers"] = evaluate("hf", reference_model(tokenizer), task_dir, args.limit)
    report["loadavg_at_end"] = os.getloadavg()
    if "transformers" in report:
        pairs = [(a, b) for qa, qb in zip(report["http"]["loglikelihoods"], report["transformers"]["loglikelihoods"])
                 for a, b in zip(qa, qb)]
        report["max_abs_loglikelihood_diff"] = max(abs(a - b) for a, b in pairs) if pairs else None
        print(f"log-likelihoods, HTTP vs transformers: {len(pairs)} (question, answer) pairs, max |diff| "
              f"{report['max_abs_loglikelihood_diff']:.2e} nats")
    for side in ("http", "transformers"):
        if side in report:
            m = report[side]["metrics"]
            print(f"{side:>12}: acc {m.get('acc', float('nan')):.3f} ± {m.get('acc_stderr', float('nan')):.3f}, "
                  f"acc_norm {m.get('acc_norm', float('nan')):.3f} over {report[side]['samples']} questions "
                  f"in {report[side]['wall_s']:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
