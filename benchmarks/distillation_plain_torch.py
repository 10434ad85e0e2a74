"""The on-policy distillation objective in a plain-torch loop, beside the relayrl job (docs/distillation.md).

Transformers sampling at temperature 1 from the student, the teacher's log-probs of the sampled tokens, the
advantage -(log mu - log pi_teacher) per token (learner/distillation.py's), the PPO ratio against mu, token mean,
AdamW and a gradient clip of 1.0: what relayrl's distill mode computes, with no Ray, vLLM or DeepSpeed. It shows
whether a curve comes from the objective or from the pipeline.

    python benchmarks/distillation_plain_torch.py --lr 5e-5 --steps 100 [--clip-advantage 2]
"""

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.distillation import build_teacher  # noqa: E402
from demos.arithmetic_model import prepare_demo_model  # noqa: E402
from demos.warm_start import greedy_accuracy_hf  # noqa: E402
from learner.distillation import reverse_kl_per_token, teacher_advantages  # noqa: E402
from protocols.config import load_config  # noqa: E402
from rewards.arithmetic import verify_arithmetic  # noqa: E402
from rewards.datasets import load_prompts  # noqa: E402


def response_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """(B, T) log-probs of ids[:, start:] under `model`; left-padded rows get positions from their mask."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0][:, start - 1:]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--clip-advantage", type=float, default=0.0, help="0: none")
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    cfg = load_config(None, [])
    student_path, teacher_path = prepare_demo_model(), build_teacher()
    tok = AutoTokenizer.from_pretrained(student_path)
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    train, _ = load_prompts(cfg.data, "train", tok)
    test, _ = load_prompts(cfg.data, "test", tok)
    test = test[: cfg.data.num_eval_prompts]
    pad, eos, group = tok.pad_token_id, tok.eos_token_id, cfg.rollout.samples_per_prompt
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    print("held-out before", greedy_accuracy_hf(student, tok, test, verify_arithmetic), flush=True)
    for step in range(1, args.steps + 1):
        batch = random.sample(train, cfg.learner.prompts_per_step)
        width = max(len(p.prompt_token_ids) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in batch])
        prompt_mask = (ids != pad).long()
        with torch.no_grad():
            out = student.generate(input_ids=ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, max_new_tokens=cfg.rollout.max_response_tokens,
                                   num_return_sequences=group, eos_token_id=eos, pad_token_id=pad)
        response = out[:, width:]
        is_eos = response == eos
        past_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # tokens after the first EOS
        loss_mask = ~past_eos & ((response != pad) | is_eos)
        mask = torch.cat([prompt_mask.repeat_interleave(group, 0), loss_mask.long()], 1)
        with torch.no_grad():
            behavior = response_logprobs(student, out, mask, width)
            teacher_lp = response_logprobs(teacher, out, mask, width)
        adv = teacher_advantages(behavior, teacher_lp, loss_mask)
        if args.clip_advantage:
            adv = adv.clamp(-args.clip_advantage, args.clip_advantage)
        ratio = torch.exp(response_logprobs(student, out, mask, width) - behavior)
        loss = -(ratio * adv)[loss_mask].mean()
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            kl = reverse_kl_per_token(behavior, teacher_lp, loss_mask)[loss_mask].mean()
            print(f"step {step}: reverse KL {float(kl):.3f}, grad norm {float(norm):.1f}", flush=True)
        if step % 50 == 0:
            print(f"step {step}: held-out {greedy_accuracy_hf(student, tok, test, verify_arithmetic):.3f}", flush=True)


if __name__ == "__main__":
    main()
