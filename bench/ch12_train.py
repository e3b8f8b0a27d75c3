"""``python -m bench.ch12_train`` (part of ``make report``): chapter 12's training run — a tiny
Hugging Face Llama trained from scratch on a public-domain text shipped in the repository
(``data/gettysburg_address.txt``, Lincoln's Gettysburg Address, 1863), once as ``transformers``
wrote it and once patched with :func:`kernel_ladder.patch.patch_model`, from the same initial weights on
the same batches.

The claim it checks: patching changes the arithmetic's rounding, not the training. Both runs'
losses are recorded at every step; the largest gap between them is reported beside the loss
itself, and the run fails (exit 1) if the gap ever exceeds ``1e-3`` of the loss, or if the loss
did not fall. The tokenizer is characters (the text's own alphabet), so nothing is downloaded.

Writes the curve to ``docs/results/ch12_train.json`` (the chapter plots it), the plot to
``docs/img/ch12_train_loss.png`` and a short table between the training markers of
``docs/results.md``, stamped with the machine. ``--steps`` and ``--no-write`` for a quick look.
On a CPU every patched launch runs in Triton's interpreter: the step times say how slow that is,
not how fast the kernels are.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from bench.report import ROOT, _progress, machine, write_between

BEGIN, END = "<!-- train:begin -->", "<!-- train:end -->"
TEXT = ROOT / "data" / "gettysburg_address.txt"
CURVE = ROOT / "docs" / "results" / "ch12_train.json"
PLOT = ROOT / "docs" / "img" / "ch12_train_loss.png"
GAP_LIMIT = 1e-3  # relative: the largest |patched - reference| loss gap allowed, over the loss


@dataclass
class TrainConfig:
    """The run: a 2-layer Llama (GQA) over the text's characters, AdamW, fixed seeds."""

    steps: int = 200
    batch_size: int = 4
    seq_len: int = 32
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    lr: float = 3e-3
    seed: int = 0


@dataclass
class TrainRun:
    """Both runs' losses per step, and what the patch replaced."""

    config: TrainConfig
    vocab: str
    parameters: int
    replaced: dict[str, int]
    reference_loss: list[float] = field(default_factory=list)
    patched_loss: list[float] = field(default_factory=list)
    reference_seconds: float = 0.0
    patched_seconds: float = 0.0
    machine: str = ""

    @property
    def max_relative_gap(self) -> float:
        return max(abs(p - r) / r for p, r in zip(self.patched_loss, self.reference_loss))


def load_text(path: pathlib.Path = TEXT) -> tuple[str, torch.Tensor]:
    """The text's alphabet (sorted characters) and the text as int64 ids into it."""
    text = path.read_text()
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([index[c] for c in text], dtype=torch.int64)


def batches(ids: torch.Tensor, config: TrainConfig) -> list[torch.Tensor]:
    """``steps`` batches of random windows of ``seq_len`` tokens, fixed by the seed. A window is both the
    input and the labels: the model predicts each token from those before it, ``seq_len - 1`` predictions."""
    if ids.numel() < config.seq_len:
        raise ValueError(f"ch12_train: the text has {ids.numel()} tokens, fewer than seq_len = {config.seq_len}")
    g = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, ids.numel() - config.seq_len + 1, (config.steps, config.batch_size), generator=g)
    return [torch.stack([ids[s: s + config.seq_len] for s in row.tolist()]) for row in starts]


def tiny_llama(vocab_size: int, config: TrainConfig):
    """A freshly initialized ``transformers`` Llama of the run's shape (fp32, no dropout)."""
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.seq_len,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(config.seed)
    return transformers.LlamaForCausalLM(hf_config).float().train()


def _train(model, data: list[torch.Tensor], lr: float, desc: str) -> tuple[list[float], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    start = time.perf_counter()
    for batch in _progress(data, desc):
        # the labels are the inputs: HF's model shifts them itself (token t is scored on predicting t + 1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, time.perf_counter() - start


def train(config: TrainConfig | None = None, text: pathlib.Path = TEXT) -> TrainRun:
    """Train the reference and the patched model from the same weights on the same batches."""
    import kernel_ladder.patch

    config = config or TrainConfig()
    vocab, ids = load_text(text)
    data = batches(ids, config)
    reference = tiny_llama(len(vocab), config)
    patched = copy.deepcopy(reference)
    replaced = kernel_ladder.patch.patch_model(patched)
    run = TrainRun(config, vocab, sum(p.numel() for p in reference.parameters()), replaced, machine=machine())
    run.reference_loss, run.reference_seconds = _train(reference, data, config.lr, "transformers")
    run.patched_loss, run.patched_seconds = _train(patched, data, config.lr, "patched")
    return run


def table(run: TrainRun) -> str:
    c = run.config
    marks = sorted({0, 9, 49, 99, c.steps - 1} & set(range(c.steps)))
    lines = [
        BEGIN,
        "## Chapter 12: training a tiny Llama, patched against transformers",
        "",
        f"`python -m bench.ch12_train`: a {c.num_hidden_layers}-layer Llama ({run.parameters:,} parameters, "
        f"hidden {c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads) over the "
        f"{len(run.vocab)} characters of `data/gettysburg_address.txt`, AdamW lr {c.lr}, batch "
        f"{c.batch_size} windows of {c.seq_len} characters ({c.seq_len - 1} next-character predictions each), "
        f"{c.steps} steps, from the same initial weights on the same "
        "batches. Machine: " + run.machine + ".",
        "",
        "| step | transformers loss | patched loss | relative gap |",
        "|---:|---:|---:|---:|",
    ]
    for i in marks:
        r, p = run.reference_loss[i], run.patched_loss[i]
        lines.append(f"| {i + 1} | {r:.4f} | {p:.4f} | {abs(p - r) / r:.1e} |")
    lines += [
        "",
        f"Largest relative gap over all {c.steps} steps: {run.max_relative_gap:.1e}. Wall time: transformers "
        f"{run.reference_seconds:.0f} s, patched {run.patched_seconds:.0f} s (the patched run's kernels execute in "
        "Triton's interpreter on a CPU: a statement about the interpreter, not the kernels).",
        "",
        "![training loss](img/ch12_train_loss.png)",
        END,
    ]
    return "\n".join(lines)


def plot(run: TrainRun, path: pathlib.Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = range(1, len(run.reference_loss) + 1)
    ax.plot(steps, run.reference_loss, label="transformers", lw=3, alpha=0.5)
    ax.plot(steps, run.patched_loss, label="patched (kernels)", lw=1)
    ax.set(xlabel="step", ylabel="training loss (nats per character)", title="same weights, same batches")
    ax.legend()
    rel = [abs(p - r) / r for p, r in zip(run.patched_loss, run.reference_loss)]
    gap.semilogy(steps, [max(v, 1e-9) for v in rel])
    gap.set(xlabel="step", ylabel="|patched − transformers| / loss", title="the gap is rounding")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    run = train(TrainConfig(steps=args.steps))
    text = table(run)
    print(text)
    failed = []
    if run.max_relative_gap > GAP_LIMIT:
        failed.append(f"the patched loss left the reference's by {run.max_relative_gap:.1e} (> {GAP_LIMIT:g})")
    if not run.patched_loss[-1] < run.patched_loss[0]:
        failed.append("the loss did not fall")
    if not args.no_write:
        CURVE.parent.mkdir(parents=True, exist_ok=True)
        CURVE.write_text(json.dumps({**asdict(run), "max_relative_gap": run.max_relative_gap}, indent=1) + "\n")
        plot(run)
        write_between(ROOT / "docs" / "results.md", BEGIN, END, text)
    for message in failed:
        print(f"ch12_train: {message}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
