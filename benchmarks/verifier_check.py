"""Does a trained solver-verifier verifier check answers, or answer one way whatever it is shown?

Scores an exported verifier (`<checkpoint root>/export/step-NNNNNN/verifier`, a Hugging Face model
directory) on every sum of the workflow (operands 0..max_operand) with every one-digit answer, as the
workflow asks it (its chat template, `verifier_question`): the probability of `y` among `y`/`n` at the
sampling temperature, for right and for wrong answers, and the accuracy of its likelier verdict with
right and wrong answers weighted equally. 0.5 is what a verifier that always answers one way scores.

    .venv/bin/python benchmarks/verifier_check.py runs/sv/checkpoints/export/step-000060/verifier
    .venv/bin/python benchmarks/verifier_check.py EXPORT --max-operand 1     # the LoRA example
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path, help="the verifier's exported model directory")
    ap.add_argument("--max-operand", type=int, default=2, help="the workflow's max_operand (default 2)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl_runtime.workflows.solver_verifier import Problem, verifier_question

    tok = AutoTokenizer.from_pretrained(args.export)
    model = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32).eval()
    verdicts = tok.convert_tokens_to_ids(["y", "n"])
    p_yes: dict[bool, list[float]] = {True: [], False: []}
    for a in range(args.max_operand + 1):
        for b in range(args.max_operand + 1):
            problem = Problem(a, b)
            for shown in range(2 * args.max_operand + 1):
                messages = [{"role": "user", "content": verifier_question(problem, str(shown))}]
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = tok(text, return_tensors="pt").input_ids
                with torch.no_grad():
                    logits = model(ids).logits[0, -1, verdicts] / args.temperature
                p_yes[shown == problem.answer].append(float(torch.softmax(logits, -1)[0]))
    print("| answers | count | mean p(y) | min | max | verdict right |")
    print("|---|---|---|---|---|---|")
    accuracy = []
    for right, ps in p_yes.items():
        hits = sum((p > 0.5) == right for p in ps) / len(ps)
        accuracy.append(hits)
        kind = "right" if right else "wrong"
        print(
            f"| {kind} | {len(ps)} | {sum(ps) / len(ps):.3f} | {min(ps):.3f} | {max(ps):.3f} | {hits:.3f} |"
        )
    print(f"\nbalanced accuracy {sum(accuracy) / 2:.3f} (0.5: one verdict whatever the answer)")
    print(f"export={args.export} max_operand={args.max_operand} temperature={args.temperature}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
