"""The on-policy distillation objectives in a plain-torch loop, beside the relayrl jobs (docs/distillation.md).

Transformers sampling from the student, the teacher's scores of the sampled responses, AdamW and a gradient clip
of 1.0, greedy held-out accuracy every `--eval-every` steps: what relayrl's distill modes compute, with no Ray,
vLLM or DeepSpeed. It shows whether a curve comes from the objective or from the pipeline, and tries settings in
seconds. `--loss`:

    sampled  the per-token advantage -(log mu - log pi_teacher) of the sampled token, the PPO ratio against mu
             (learner/distillation.py teacher_advantages; relayrl's `distill` mode)
    topk     the forward KL from the teacher's top `--k` tokens at every position of the student's own samples
             (learner/distillation.py topk_forward_kl; relayrl's `distill_topk` modes)
    sft      cross-entropy on the gold answers of the same prompts (the supervised warm start's loss, for scale)

    python benchmarks/distillation_plain_torch.py --loss topk --lr 5e-5 --prompts 64 --samples 2 --steps 100
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.distillation import build_teacher  # noqa: E402
from demos.arithmetic_model import prepare_demo_model  # noqa: E402
from demos.warm_start import greedy_accuracy_hf  # noqa: E402
from learner.distillation import reverse_kl_per_token, teacher_advantages, topk_forward_kl  # noqa: E402
from learner.lr_schedule import warmup_schedule  # noqa: E402
from protocols.config import load_config  # noqa: E402
from rewards.arithmetic import verify_arithmetic  # noqa: E402
from rewards.datasets import load_prompts  # noqa: E402


def response_log_softmax(model, ids: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """(B, T, V) log-softmax predicting ids[:, start:] under `model`; left-padded rows get positions from
    their mask."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, start - 1:-1].float()
    return torch.log_softmax(logits, -1)


def sampled_accuracy(model, tok, prompts, temperature: float, samples: int = 4) -> float:
    """Mean verifier accuracy of `samples` responses a prompt sampled at `temperature` (top_p 1)."""
    pad, eos = tok.pad_token_id, tok.eos_token_id
    width = max(len(p.prompt_token_ids) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != pad).long(), do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=8,
                             num_return_sequences=samples, eos_token_id=eos, pad_token_id=pad)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(verify_arithmetic(prompts[i // samples], t).correct for i, t in enumerate(texts)) / len(texts)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("sampled", "topk", "sft"), default="sampled")
    parser.add_argument("--k", type=int, default=15, help="topk: the teacher's ids a position (15: all)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps (learner.lr_warmup_steps)")
    parser.add_argument("--decay", type=int, default=0,
                        help="cosine lr decay steps after the warm-up, to 0 (learner.lr_decay_steps)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--clip-advantage", type=float, default=0.0, help="sampled: clip |A| (0: none)")
    parser.add_argument("--sampled-accuracy", action="store_true",
                        help="print the student's and teacher's accuracy sampled at temperature 1 and 0.6 first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    cfg = load_config(None, [])
    student_path, teacher_path = prepare_demo_model(), build_teacher()
    tok = AutoTokenizer.from_pretrained(student_path)
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    train, _ = load_prompts(cfg.data, "train", tok)
    test, _ = load_prompts(cfg.data, "test", tok)
    test = test[: cfg.data.num_eval_prompts]
    pad, eos, group = tok.pad_token_id, tok.eos_token_id, args.samples
    if args.sampled_accuracy:
        for name, model in (("student", student), ("teacher", teacher)):
            greedy = greedy_accuracy_hf(model, tok, test, verify_arithmetic)
            at = {t: sampled_accuracy(model, tok, test, t) for t in (1.0, 0.6)}
            print(f"{name}: greedy {greedy:.3f}, sampled at T=1 {at[1.0]:.3f}, at T=0.6 {at[0.6]:.3f}", flush=True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = warmup_schedule(optimizer, args.warmup, decay_steps=args.decay)
    print(f"held-out before {greedy_accuracy_hf(student, tok, test, verify_arithmetic):.3f}", flush=True)
    t0, kls, norms = time.perf_counter(), [], []
    for step in range(1, args.steps + 1):
        batch = random.sample(train, args.prompts)
        width = max(len(p.prompt_token_ids) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in batch])
        prompt_mask = (ids != pad).long()
        if args.loss == "sft":
            answers = [tok(p.answer, add_special_tokens=False).input_ids + [eos] for p in batch]
            longest = max(len(a) for a in answers)
            response = torch.tensor([a + [pad] * (longest - len(a)) for a in answers])
            out = torch.cat([ids, response], 1)
            loss_mask = torch.tensor([[j < len(a) for j in range(longest)] for a in answers])
        else:
            with torch.no_grad():
                out = student.generate(input_ids=ids, attention_mask=prompt_mask, do_sample=True,
                                       temperature=args.temperature, top_k=0, top_p=1.0,
                                       max_new_tokens=cfg.rollout.max_response_tokens, num_return_sequences=group,
                                       eos_token_id=eos, pad_token_id=pad)
            response = out[:, width:]
            is_eos = response == eos
            past_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # tokens after the first EOS
            loss_mask = ~past_eos & ((response != pad) | is_eos)
            prompt_mask = prompt_mask.repeat_interleave(group, 0)
        mask = torch.cat([prompt_mask, loss_mask.long()], 1)
        targets = out[:, width:, None]
        student_lsm = response_log_softmax(student, out, mask, width)
        logprobs = student_lsm.gather(-1, targets)[..., 0]
        if args.loss == "sft":
            loss = -logprobs[loss_mask].mean()
        else:
            with torch.no_grad():
                teacher_lsm = response_log_softmax(teacher, out, mask, width)
            behavior = logprobs.detach()
            kl = reverse_kl_per_token(behavior, teacher_lsm.gather(-1, targets)[..., 0], loss_mask)
            kls.append(float(kl[loss_mask].mean()))
            if args.loss == "sampled":
                adv = teacher_advantages(behavior, teacher_lsm.gather(-1, targets)[..., 0], loss_mask)
                if args.clip_advantage:
                    adv = adv.clamp(-args.clip_advantage, args.clip_advantage)
                loss = -(torch.exp(logprobs - behavior) * adv)[loss_mask].mean()
            else:
                top = teacher_lsm.topk(args.k, dim=-1)
                loss = topk_forward_kl(student_lsm.gather(-1, top.indices), top.values, loss_mask)[loss_mask].mean()
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)))
        optimizer.step()
        schedule.step()
        if step % args.eval_every == 0:
            acc = greedy_accuracy_hf(student, tok, test, verify_arithmetic)
            recent = kls[-args.eval_every:]
            kl_text = f", reverse KL {sum(recent) / len(recent):.3f}" if recent else ""
            print(f"step {step}: held-out {acc:.3f}, loss {float(loss.detach()):.3f}{kl_text}, grad norm "
                  f"{sum(norms[-args.eval_every:]) / args.eval_every:.2f}, {time.perf_counter() - t0:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
