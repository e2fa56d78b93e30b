"""smollm2-moe across (experts, top-k): perplexity against dense SmolLM2 and the expert-load skew.

    python -m bench.moe_skew                           # the default sweep
    python -m bench.moe_skew --configs 8:2,8:4 --histogram 8:2

Each configuration is derived in memory exactly as `deepinfer-launch fetch smollm2-moe --experts E --top-k K`
writes it (deepinfer/loading/derive_moe.py), then run by the module's plain-torch forward on the fixed text
deepinfer/data/moe_eval.txt (written for this project, public domain; not the calibration text). Skew is, per
layer, the busiest expert's token count over the mean count; the table gives the worst layer and the mean
over layers. numpy and torch only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from deepinfer.loading import derive_moe as dm
from deepinfer.loading import moe_report as mr
from deepinfer.loading.fetch import fetch_smollm2
from deepinfer.loading.weights import load_model_weights
from deepinfer.text.tokenizer import Tokenizer

DEFAULT_CONFIGS = "8:1,8:2,8:4,8:6,8:7,8:8,4:2,16:4"


def parse_configs(text: str) -> list[tuple[int, int]]:
    return [(int(e), int(k)) for e, k in (item.split(":") for item in text.split(",") if item)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated experts:top_k")
    parser.add_argument("--histogram", default=f"{dm.DEFAULT_NUM_EXPERTS}:{dm.DEFAULT_TOP_K}",
                        help="print the per-layer tokens-per-expert histogram of this experts:top_k")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    gguf = fetch_smollm2(progress=True)
    dense = load_model_weights(gguf)
    tok = Tokenizer.from_gguf(gguf)
    ids = tok.encode(dm.EVAL_TEXT.read_text())
    calibration = tok.encode(dm.CALIBRATION_TEXT.read_text())
    logits, _ = dm.forward(dense.config, dense.state_dict, ids)
    dense_ppl = mr.perplexity(logits, ids)
    print(f"fixed text {dm.EVAL_TEXT.name}: {len(ids)} tokens; calibration {dm.CALIBRATION_TEXT.name}: "
          f"{len(calibration)} tokens; dense SmolLM2 perplexity {dense_ppl:.3f}")
    print(f"{'E':>3} {'k':>3} {'perplexity':>12} {'x dense':>8} {'skew worst':>11} {'skew mean':>10} {'derive s':>9}")
    rows = []
    for experts, top_k in parse_configs(args.configs):
        t0 = time.perf_counter()
        moe = dm.derive_moe(dense.config, dense.state_dict, calibration, experts, top_k)
        took = time.perf_counter() - t0
        logits, routes = dm.forward(dense.config, dense.state_dict, ids, moe)
        report = mr.MoeReport(len(ids), dense_ppl, mr.perplexity(logits, ids), mr.expert_load(routes, experts))
        skew = report.skew
        print(f"{experts:>3} {top_k:>3} {report.moe_perplexity:>12.3f} {report.moe_perplexity / dense_ppl:>8.2f} "
              f"{skew.max():>11.2f} {skew.mean():>10.2f} {took:>9.1f}", flush=True)
        rows.append({"experts": experts, "top_k": top_k, "perplexity": report.moe_perplexity,
                     "skew_worst": float(skew.max()), "skew_mean": float(skew.mean()),
                     "load": report.load.tolist()})
        if f"{experts}:{top_k}" == args.histogram:
            print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(ids), "dense_perplexity": dense_ppl, "configs": rows}, f, indent=2)
    print("reproduce: python -m bench.moe_skew " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
