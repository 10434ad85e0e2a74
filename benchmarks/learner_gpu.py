"""Learner throughput on one GPU: `LearnerRank.train_step` (DeepSpeed ZeRO-2, bf16, torch AdamW) against a plain
torch loop over the same micro-batches, plus the weight-publish path. A script, not a test; it needs CUDA.

    python benchmarks/learner_gpu.py                      # Qwen2.5-0.5B shape, responses 1024 and 4096
    python benchmarks/learner_gpu.py --shapes 0.5b,1.5b   # also the 1.5B shape
    python benchmarks/learner_gpu.py --out results/       # also writes table.txt and results.json

No downloads: it builds a random-init Qwen2 model of the named shape with a trivial tokenizer in a temp folder.
Each configuration runs three learners on identical synthetic micro-batches (prompt 256 tokens, fixed response
length, advantages +-1, behavior log-probs ~ -2; preset dapo, so no reference model and no entropy bonus):

  ds       LearnerRank.train_step: DeepSpeed ZeRO-2 engine, bf16 with fp32 master weights (what relayrl runs).
  plain    plain torch with the learner's own scoring (learner.batch.response_logits: (B, T, V) logits of the
           response positions via logits_to_keep; token_logprobs; the entropy metric as in train_step) and
           compute_policy_loss; backward; fp32 master weights with fp32 gradient accumulation, grad-norm
           clipping and torch AdamW on the masters, copied back to bf16: the same arithmetic as DeepSpeed's bf16
           path, minus DeepSpeed. ds/plain is DeepSpeed's overhead.
  chunked  as plain, but log-probs come from the decoder's hidden states at the response positions through the
           LM head in checkpointed chunks of --chunk-tokens positions, so (B, T, V) logits are never
           materialised: what a fused "linear + log-softmax" scorer would save in memory and time.

Timed steps exclude warm-up; torch.cuda.synchronize() brackets every timing. TFLOP/s counts *model* FLOPs
(_gpu_common.train_flops: 6 x the weights in matrix products x tokens, plus causal attention; the same count as
long_cot_gpu.py's MFU): recomputation under gradient checkpointing is not counted, so it understates the hardware's
work with checkpointing on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._gpu_common import (  # noqa: E402
    VOCAB,
    Phases,
    Result,
    build_model_folder,
    free_memory,
    free_port,
    make_shard,
    peak_gib,
    reset_peak,
    sync,
    train_flops,
)
from benchmarks._plain_learner import run_plain  # noqa: E402


# ------------------------------------------------------------------------------------------------- runners


def run_ds(cfg, folder: Path, shard, normalizer, port: int, warmup: int, steps: int, res: Result,
           publish: bool, publish_reps: int) -> dict | None:
    from learner.learner_actor import LearnerRank
    from weights.object_store import pack_state_dict, packed_num_bytes

    t0 = time.perf_counter()
    learner = LearnerRank(cfg, rank=0, world_size=1, model_path=str(folder))
    learner.setup("127.0.0.1", port)
    sync()
    res.setup_s = time.perf_counter() - t0
    for i in range(warmup):
        metrics = learner.train_step(shard, normalizer)
        if i == 0:
            res.first_loss = metrics["loss"]
    sync()
    reset_peak()
    t0 = time.perf_counter()
    for _ in range(steps):
        learner.train_step(shard, normalizer)
    sync()
    res.s_per_step = (time.perf_counter() - t0) / steps
    res.peak_gib = peak_gib()

    # One more step with synchronising wrappers around DeepSpeed's backward and step: the phase split.
    eng = learner.engine
    ph = Phases()
    orig_backward, orig_step = eng.backward, eng.step

    def timed(fn, slot):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            setattr(ph, slot, getattr(ph, slot) + time.perf_counter() - t)
            return out
        return wrapper

    eng.backward, eng.step = timed(orig_backward, "bwd"), timed(orig_step, "opt")
    sync()
    t0 = time.perf_counter()
    learner.train_step(shard, normalizer)
    sync()
    total = time.perf_counter() - t0
    ph.fwd = total - ph.bwd - ph.opt  # forward, scoring, loss, collate and metric syncs
    res.phases = asdict(ph)
    eng.backward, eng.step = orig_backward, orig_step

    pub = None
    if publish:
        full, pack, nbytes, ntensors = [], [], 0, 0
        for _ in range(publish_reps):
            sync()
            t = time.perf_counter()
            state = learner._full_state_dict()
            t1 = time.perf_counter()
            packed = pack_state_dict(state)
            t2 = time.perf_counter()
            full.append(t1 - t)
            pack.append(t2 - t1)
            nbytes, ntensors = packed_num_bytes(packed), len(packed)
            del state, packed
        pub = {"bytes": nbytes, "full_state_dict_s": min(full), "pack_state_dict_s": min(pack),
               "total_s": min(a + b for a, b in zip(full, pack)), "reps": publish_reps, "tensors": ntensors}
        pub["GB_per_s"] = nbytes / pub["total_s"] / 1e9
        pub["alternatives"] = publish_alternatives(learner, publish_reps)
    if hasattr(learner.engine, "destroy"):
        learner.engine.destroy()
    del learner, eng, orig_backward, orig_step
    free_memory()
    return pub


def publish_alternatives(learner, reps: int) -> dict:
    """Candidate fixes for the publish path, timed on the same module (not used by relayrl; numbers only):
    nocopy     {k: v.cpu()}: _full_state_dict without its extra .clone() (.cpu() of a GPU tensor already copies)
    pinned     device-to-host copies into page-locked buffers allocated once and reused for every version
    pinned_untied  as pinned, without the duplicate lm_head of a tied model (a GPU vLLM engine re-ties it)"""
    from weights.object_store import pack_state_dict, packed_num_bytes

    sd = learner.engine.module.state_dict()
    if learner.tied and "lm_head.weight" not in sd:
        sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    untied = {k: v for k, v in sd.items() if not (learner.tied and k == "lm_head.weight")}
    out = {}

    def best(fn):
        times, nbytes = [], 0
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            packed = pack_state_dict(fn())
            times.append(time.perf_counter() - t)
            nbytes = packed_num_bytes(packed)
        return {"s": min(times), "bytes": nbytes, "GB_per_s": nbytes / min(times) / 1e9}

    out["nocopy"] = best(lambda: {k: v.detach().cpu() for k, v in sd.items()})
    for name, src in (("pinned", sd), ("pinned_untied", untied)):
        bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=torch.cuda.is_available()) for k, v in src.items()}

        def copy(src=src, bufs=bufs):
            for k, v in src.items():
                bufs[k].copy_(v.detach(), non_blocking=True)
            sync()
            return bufs
        out[name] = best(copy)
        del bufs
    return out



# ---------------------------------------------------------------------------------------------------- main


def fmt_row(r: Result, ds_s: float | None) -> str:
    ratio = "" if r.variant == "ds" else f"{ds_s / r.s_per_step:6.2f}" if ds_s else "   n/a"
    ph = r.phases
    split = f"{ph.get('fwd', float('nan')):5.2f}/{ph.get('bwd', float('nan')):5.2f}/{ph.get('opt', float('nan')):5.2f}"
    if r.error:
        return (f"{r.shape:5} {r.variant:8} {r.resp_len:5d} {r.micro_batch:3d} {'on' if r.grad_ckpt else 'off':4} "
                f"ERROR: {r.error}")
    return (f"{r.shape:5} {r.variant:8} {r.resp_len:5d} {r.micro_batch:3d} {'on' if r.grad_ckpt else 'off':4} "
            f"{r.s_per_step:8.3f} {r.resp_tok_s:10.0f} {r.total_tok_s:10.0f} {r.model_tflops:8.1f} "
            f"{r.peak_gib:8.2f} {split:>17} {ratio:>6} {r.first_loss:10.4e}")


HEADER = (f"{'shape':5} {'variant':8} {'resp':>5} {'mb':>3} {'gc':4} {'s/step':>8} {'resp tok/s':>10} "
          f"{'tot tok/s':>10} {'TFLOP/s':>8} {'peak GiB':>8} {'fwd/bwd/opt s':>17} {'ds/x':>6} {'loss@1':>10}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b", help="comma list of 0.5b, 1.5b")
    ap.add_argument("--configs", default="1024:4,1024:8,4096:1,4096:2",
                    help="comma list of resp_len:micro_batch for the first shape")
    ap.add_argument("--configs-large", default="1024:8,4096:2",
                    help="resp_len:micro_batch for shapes after the first (1.5b)")
    ap.add_argument("--grad-ckpt", default="off,on", help="comma list of off, on")
    ap.add_argument("--variants", default="ds,plain,chunked")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples-per-step", type=int, default=16, help="global batch (one rank)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="positions per LM-head chunk (chunked)")
    ap.add_argument("--publish-reps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="skip remaining configurations once this many seconds have passed")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for table.txt and results.json")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test of the script only
    args = ap.parse_args()

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/learner_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "it measures the DeepSpeed learner in bf16 and has nothing to say on CPU.", file=sys.stderr)
        return 2

    from learner.objective import count_normalizer
    from protocols.config import load_config

    start = time.perf_counter()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    dev_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    import deepspeed
    import transformers

    transformers.utils.logging.disable_progress_bar()

    env = (f"device {dev_name}; torch {torch.__version__}; transformers {transformers.__version__}; "
           f"deepspeed {deepspeed.__version__}; python {sys.version.split()[0]}")
    print(env, flush=True)
    lines = [env, f"samples/step {args.samples_per_step}, prompt {args.prompt_len} tokens, warmup {args.warmup}, "
             f"timed {args.steps} steps; ds/x = DeepSpeed s/step over this variant's s/step; "
             "fwd/bwd/opt = one extra synchronised step split at backward and optimizer (fwd includes scoring, "
             "loss and collate); loss@1 = loss of the first warm-up step (variants must agree)", HEADER]
    print(lines[1], "\n" + HEADER, flush=True)
    results: list[dict] = []
    publish_info: dict = {}
    port = free_port()
    gcs = [g.strip() == "on" for g in args.grad_ckpt.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"

    def dump() -> None:
        if out:
            (out / "table.txt").write_text("\n".join(lines) + "\n")
            (out / "results.json").write_text(json.dumps({"env": env, "args": vars(args), "results": results,
                                                          "publish": publish_info}, indent=1))

    with tempfile.TemporaryDirectory(prefix="relayrl-learner-bench-") as tmp:
        for si, shape in enumerate(s.strip() for s in args.shapes.split(",")):
            t = time.perf_counter()
            folder, n_params = build_model_folder(shape, Path(tmp), args.vocab,
                                                  "cuda" if torch.cuda.is_available() else "cpu")
            msg = f"# {shape}: {n_params / 1e6:.1f}M parameters (tied head counted once), built in " \
                  f"{time.perf_counter() - t:.1f}s"
            print(msg, flush=True)
            lines.append(msg)
            configs = [tuple(int(x) for x in c.split(":"))
                       for c in (args.configs if si == 0 else args.configs_large).split(",")]
            for resp_len, mb in configs:
                shard = make_shard(args.samples_per_step, args.prompt_len, resp_len, args.vocab, seed=resp_len)
                normalizer = count_normalizer(shard.loss_mask, resp_len)
                for gc_on in gcs:
                    if time.perf_counter() - start > args.budget_s:
                        msg = f"# budget of {args.budget_s:.0f}s spent: skipped {shape} resp {resp_len} mb {mb} " \
                              f"gc {'on' if gc_on else 'off'}"
                        print(msg, flush=True)
                        lines.append(msg)
                        continue
                    cfg = load_config(None, [
                        f"cluster.use_gpus={'true' if torch.cuda.is_available() else 'false'}",
                        f"model.dtype={dtype}", f"model.path={folder}",
                        "algorithm.preset=dapo", "learner.zero_stage=2", f"learner.micro_batch_size={mb}",
                        f"learner.gradient_checkpointing={'true' if gc_on else 'false'}",
                        f"learner.prompts_per_step={args.samples_per_step // 8}", "rollout.samples_per_prompt=8",
                        f"rollout.max_response_tokens={resp_len}", f"data.max_prompt_tokens={args.prompt_len}",
                    ])
                    ds_s = None
                    for variant in variants:
                        res = Result(shape, variant, resp_len, mb, gc_on, args.samples_per_step, args.steps)
                        try:
                            if variant == "ds":
                                want_pub = si == 0 and not publish_info and args.publish_reps > 0
                                pub = run_ds(cfg, folder, shard, normalizer, port, args.warmup, args.steps, res,
                                             want_pub, args.publish_reps)
                                if pub:
                                    publish_info.update(pub, shape=shape)
                            else:
                                run_plain(cfg, folder, shard, normalizer, args.warmup, args.steps, res,
                                          chunked=variant == "chunked", chunk_tokens=args.chunk_tokens)
                        except Exception as err:  # report and go on (e.g. out of memory)
                            import traceback

                            traceback.print_exc()
                            res.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                            free_memory()
                        if not res.error:
                            resp_tokens = args.samples_per_step * resp_len
                            total_tokens = args.samples_per_step * (resp_len + args.prompt_len)
                            res.resp_tok_s = resp_tokens / res.s_per_step
                            res.total_tok_s = total_tokens / res.s_per_step
                            flops = args.samples_per_step * train_flops(shape, args.vocab, resp_len + args.prompt_len)
                            res.model_tflops = flops / res.s_per_step / 1e12
                            if variant == "ds":
                                ds_s = res.s_per_step
                        results.append(asdict(res))
                        row = fmt_row(res, ds_s)
                        print(row, flush=True)
                        lines.append(row)
                        dump()
            if publish_info and "line" not in publish_info:
                p = publish_info
                p["line"] = (f"# weight publish ({p['shape']}, ZeRO-2, bf16): _full_state_dict "
                             f"{p['full_state_dict_s']:.3f}s"
                             f" + pack_state_dict {p['pack_state_dict_s']:.3f}s = {p['total_s']:.3f}s for "
                             f"{p['bytes'] / 1e9:.3f} GB ({p['tensors']} tensors) -> {p['GB_per_s']:.2f} GB/s "
                             f"(best of {p['reps']}; ray.put not included)")
                print(p["line"], flush=True)
                lines.append(p["line"])
                for name, a in p.get("alternatives", {}).items():
                    alt = (f"#   alternative {name:14}: {a['s']:.3f}s for {a['bytes'] / 1e9:.3f} GB -> "
                           f"{a['GB_per_s']:.2f} GB/s (incl. pack_state_dict)")
                    print(alt, flush=True)
                    lines.append(alt)
            dump()
    lines.append(f"# wall {time.perf_counter() - start:.0f}s")
    print(lines[-1])
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
