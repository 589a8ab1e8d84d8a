"""A built-in demo family: ``python -m mergefs.cli.demo build DIR`` and ``... run MODEL_DIR``.

``build`` writes a tiny Llama base (transformers' ``save_pretrained``, float32, about 3 MiB) and
three fine-tune-like experts with different delta shapes, as found in practice:

- ``expert-lora``: a rank-4 update of the attention q/v projections only (everything else
  bit-identical to the base, like a merged LoRA fine-tune);
- ``expert-mlp``: small dense deltas on the MLP weights only;
- ``expert-full``: small dense deltas on every weight but the norms (a full fine-tune);

and ``DIR/spec.yaml`` (task arithmetic, a 25% expert-read budget, 16 KiB blocks). ``run`` loads
a model directory (the mount) with ``from_pretrained``, runs one forward pass and prints what
it computed. Needs torch and transformers (the ``test`` extra); not imported by the package.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SPEC = """\
# mergefs demo: a tiny Llama base and three experts (see mergefs/cli/demo.py)
merge_method: task_arithmetic
base_model: ./base
models:
  - model: ./expert-lora
    parameters: {weight: 0.6}
  - model: ./expert-mlp
    parameters: {weight: 0.4}
  - model: ./expert-full
    parameters: {weight: 0.3}
budget: 25%
block_size: 16KiB
"""

TOKENS = [1, 15, 27, 99, 4, 310, 7, 42]


def build(root: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root / "base")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def dense(w: torch.Tensor, rel: float) -> torch.Tensor:
        return w + torch.randn(w.shape, generator=gen) * rel * w.pow(2).mean().sqrt()

    def lora(w: torch.Tensor, rank: int = 4) -> torch.Tensor:
        a = torch.randn(w.shape[0], rank, generator=gen)
        b = torch.randn(rank, w.shape[1], generator=gen)
        return w + (a @ b) * 0.02 * w.pow(2).mean().sqrt() / rank

    experts = {
        "expert-lora": lambda n, w: lora(w) if n.endswith(("q_proj.weight", "v_proj.weight"))
        else w,
        "expert-mlp": lambda n, w: dense(w, 0.05) if ".mlp." in n else w,
        "expert-full": lambda n, w: w if "norm" in n else dense(w, 0.02),
    }
    for name, change in experts.items():
        model.load_state_dict({n: change(n, w.clone()) for n, w in base.items()})
        model.save_pretrained(root / name)
    spec = root / "spec.yaml"
    spec.write_text(SPEC)
    return spec


def run(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    loaded = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits
    print(f"loaded {n_params:,} parameters from {model_dir} in {loaded:.2f}s")
    print(f"forward pass on {len(TOKENS)} tokens: logits {tuple(logits.shape)}, "
          f"sum {float(logits.double().sum()):.6f}")
    print(f"greedy next tokens: {logits[0].argmax(-1).tolist()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mergefs.cli.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the demo family and spec.yaml into DIR")
    b.add_argument("dir", type=Path)
    r = sub.add_parser("run", help="from_pretrained(MODEL_DIR) and one forward pass")
    r.add_argument("model_dir", type=Path)
    args = p.parse_args(argv)
    if args.command == "build":
        spec = build(args.dir)
        print(f"demo family and spec written: {spec}")
    else:
        run(args.model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
