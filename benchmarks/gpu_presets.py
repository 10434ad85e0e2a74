"""GPU check: every preset's `LearnerRank.train_step`, and every shipped config's first learner steps, on one GPU.
A script for a lent GPU machine (no Ray or vLLM needed there), not a test: CI has no GPU.

    python benchmarks/gpu_presets.py                 # every preset, then every deploy/configs/*.yaml
    python benchmarks/gpu_presets.py --shape 1.5b    # a bigger model
    python benchmarks/gpu_presets.py --presets ppo --configs ''   # the critic's step alone

Each row builds one DeepSpeed rank with `cluster.use_gpus=true` on a random-init Qwen2 of the given shape and
runs what the driver runs for one batch: reference log-probs when the preset puts the KL in the reward, then
`train_step` twice. A row fails on any exception (the in-learner reference model on the wrong device, say) and
prints it. Shipped configs keep their algorithm and learner settings; the model, the batch and the number of
ranks are shrunk to one GPU. `ppo` also builds a critic rank on the same GPU: values, then two critic updates.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._gpu_common import VOCAB, build_model_folder, free_memory, free_port, make_shard  # noqa: E402

PRESETS = ["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp"]


def run_one(cfg, folder: Path, port: int, resp_len: int, prompt_len: int, samples: int) -> dict:
    from learner.learner_actor import LearnerRank
    from learner.objective import count_normalizer, kl_for_reward, kl_in_reward

    shard = make_shard(samples, prompt_len, resp_len, VOCAB, seed=0)
    normalizer = count_normalizer(shard.loss_mask, resp_len)
    learner = LearnerRank(cfg, rank=0, world_size=1, model_path=str(folder))
    learner.setup("127.0.0.1", port)
    try:
        # Behavior log-probs near the policy's own, as vLLM's would be: random ones near -2 against a random
        # model's -12 make every importance weight ~e^-10 and the gradient vanish.
        shard = shard.with_fields(behavior_logprobs=learner.policy_logprobs(shard))
        out = {}
        if kl_in_reward(cfg.algorithm):
            ref = learner.ref_logprobs(shard)
            out["kl_reward_mean"] = float(kl_for_reward(shard.behavior_logprobs, ref, shard.loss_mask,
                                                        cfg.algorithm).mean())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2):
            metrics = learner.train_step(shard, normalizer)
        torch.cuda.synchronize()
        out.update(loss=metrics["loss"], grad_norm=metrics.get("grad_norm_max", float("nan")),
                   s_per_step=(time.perf_counter() - t0) / 2, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        if cfg.critic.enabled:
            out.update(run_critic(cfg, folder, port, shard))
        if not all(map(lambda v: v == v, (out["loss"], out["grad_norm"]))):
            raise RuntimeError(f"non-finite loss or grad norm: {out}")
        return out
    finally:
        if hasattr(learner.engine, "destroy"):
            learner.engine.destroy()
        del learner
        free_memory()
        torch.cuda.reset_peak_memory_stats()


def run_critic(cfg, folder: Path, port: int, shard) -> dict:
    """ppo: the critic rank on the same GPU stamps values on the shard, then takes two updates toward returns of
    1 on every token (stamped values as the old ones). Returns the second update's value loss, the seconds of
    the values pass and of one update, and the GPU's peak with both ranks on it."""
    from learner.critic_rank import CriticRank

    critic = CriticRank(cfg, rank=0, world_size=1, model_path=str(folder))
    critic.setup("127.0.0.1", port)  # joins the process group the learner rank already opened (world size 1)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        values, _ = critic.values(shard)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        batch = shard.with_fields(returns=torch.ones_like(values), values=values)
        for _ in range(2):
            metrics = critic.train_step(batch, float(batch.loss_mask.sum()))  # its own plan: it runs alone
        torch.cuda.synchronize()
        if not metrics["value_loss"] == metrics["value_loss"]:
            raise RuntimeError(f"non-finite critic value loss: {metrics}")
        return {"value_loss": metrics["value_loss"], "critic_values_s": t1 - t0,
                "critic_s_per_step": (time.perf_counter() - t1) / 2,
                "peak_gib_both": torch.cuda.max_memory_allocated() / 2**30}
    finally:
        del critic
        free_memory()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--resp-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--presets", default=",".join(PRESETS + ["ppo"]), help="comma list of presets to run")
    ap.add_argument("--configs", default="deploy/configs", help="folder of shipped YAML configs ('' to skip)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_presets.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from protocols.config import load_config

    port = free_port()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="relayrl-gpu-presets-") as tmp:
        folder, n_params = build_model_folder(args.shape, Path(tmp), VOCAB, "cuda")
        print(f"# {torch.cuda.get_device_name(0)}; {args.shape} ({n_params / 1e6:.0f}M), bf16, 1 rank, "
              f"{args.samples} samples x ({args.prompt_len} + {args.resp_len}) tokens", flush=True)
        common = ["cluster.use_gpus=true", "model.dtype=bfloat16", f"model.path={folder}",
                  f"rollout.max_response_tokens={args.resp_len}", f"data.max_prompt_tokens={args.prompt_len}",
                  "rollout.samples_per_prompt=8", f"learner.prompts_per_step={max(1, args.samples // 8)}",
                  "learner.num_ranks=1", "learner.micro_batch_size=4", "learner.gradient_checkpointing=true"]
        chosen = args.presets.split(",")
        jobs = [(f"preset {p}", None, [f"algorithm.preset={p}"]) for p in PRESETS if p in chosen]
        if "ppo" in chosen:
            jobs.append(("preset ppo", None,
                         ["algorithm.preset=ppo", "critic.num_workers=1", "critic.micro_batch_size=4"]))
        if args.configs:
            jobs += [(f"config {c.name}", str(c), []) for c in sorted(Path(args.configs).glob("*.yaml"))]
        for name, path, extra in jobs:
            try:
                # Shipped configs keep their algorithm and learner choices; the shape fits one GPU.
                cfg = load_config(path, [*extra, *common])
                res = run_one(cfg, folder, port, args.resp_len, args.prompt_len, args.samples)
                print(f"OK    {name:28} zero {cfg.learner.zero_stage} kl {cfg.algorithm.kl.beta:<5} "
                      f"loss {res['loss']:+.4f} grad_norm {res['grad_norm']:.3f} "
                      f"{res['s_per_step']:.2f} s/step peak {res['peak_gib']:.1f} GiB"
                      + (f" kl_reward {res['kl_reward_mean']:.4f}" if "kl_reward_mean" in res else "")
                      + (f" value_loss {res['value_loss']:.4f} critic values {res['critic_values_s']:.2f} s, "
                         f"{res['critic_s_per_step']:.2f} s/update, peak with both ranks {res['peak_gib_both']:.1f} GiB"
                         if "value_loss" in res else ""), flush=True)
            except Exception as err:  # one failing row must not hide the others
                failures += 1
                print(f"FAIL  {name:28} {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
                free_memory()
    print(f"# {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
