"""`rag-kvcache calibrate`: train a model's link calibration by distillation: link tokens
(`link.calibration`, the model frozen) or a LoRA adapter (`model.lora`, `kind="lora"`).

For link tokens the only parameters are K link-token embeddings. For each training
item (the project's own generated documents, split `train`: never the dev or test items),
the teacher is a plain prefill of the prompt with the strategy's placement: its greedy answer,
and its next-token distributions along that answer. The student is the same prompt linked
from independently encoded chunks by the strategy, with the link tokens after every document
chunk; the loss is KL(teacher || student) over the answer's tokens, fed in as the teacher
wrote them. A held-out part of the training items measures the KL before and after.

The link's own forward writes fresh K/V over stale copies in one buffer, in place, which
autograd cannot follow; `trainable_logits` computes the same attention with the new tokens'
K/V appended after the context and the stale copies masked out (a key's place in the buffer
does not matter, only the RoPE position it carries). A test holds it equal to `link`, so
what is trained is what the linker computes.

A LoRA adapter's student is `block_logits`: the same naive link as one forward over the
whole prompt with a block mask, in which the adapter's low-rank layers train (Block-Attention's
fine-tune); a test holds it equal to `link` as well.

Training is resumable: every `checkpoint_every` steps the vectors and the optimiser's state go
to OUT/checkpoint.safetensors (no pickle); `resume` continues from there, with the same items
in the same order (the order is a function of the seed and the step).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from rag_kvcache.answer import Answer
from rag_kvcache.config import EngineConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import CalibrationError, StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.block_attention import block_logits
from rag_kvcache.link.block_attention import check_trainable as check_lora_trainable
from rag_kvcache.link.calibration import Calibration, soft_inputs, with_link_slots
from rag_kvcache.link.checks import check_chunks
from rag_kvcache.link.placement import place_into
from rag_kvcache.link.selection import select_positions
from rag_kvcache.model.adapter import build_cache, embed, forward
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.calibration_file import write_atomically
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.model.lora import TARGETS, LinkLoRA, add_lora, lora_tensors, remove_lora
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools import report_json
from rag_kvcache.tools.qa_set import MAX_REPEATS, make_split

CHECKPOINT = "checkpoint.safetensors"
RESULT = "calibration.safetensors"
LORA_RESULT = "lora.safetensors"
KINDS = ("tokens", "lora")
TEACHERS = "teachers"  # the teacher's answers, kept for later runs in the same OUT
CELLS = 18  # items of one context size per repeat of the QA design


def default_lr(kind: str) -> float:
    """AdamW's learning rate when none is given: link tokens 5e-3, a LoRA adapter 5e-4."""
    return 5e-4 if kind == "lora" else 5e-3


@dataclass(frozen=True)
class CalibrateConfig:
    """What a calibration run trains and on what (the checkpoint records it: a resumed run
    must ask for the same)."""

    strategy: str = "naive+reversed"  # the strategy whose stale KV the calibration repairs
    kind: str = "tokens"  # link tokens, or a LoRA adapter ("lora")
    link_tokens: int = 4  # K per document chunk (kind "tokens")
    rank: int = 8  # the adapter's rank (kind "lora"; its alpha is twice this)
    items: int = 64  # training items (split `train`)
    held_out: int = 16  # further items, never trained on: the KL before / after
    context: str = "1K"  # the items' context size ("1K", "2K", "4K")
    steps: int = 300
    lr: float | None = None  # AdamW's; default 5e-3 for link tokens, 5e-4 for an adapter
    answer_tokens: int = 16  # teacher answer tokens distilled per item
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        strategy = Strategy.parse(self.strategy)
        if self.kind not in KINDS:
            raise CalibrationError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "lora":
            check_lora_trainable(strategy)
            if self.rank < 1:
                raise CalibrationError("the adapter's rank must be >= 1")
        elif (
            strategy.calibrated
            or strategy.uses_ape
            or strategy.kind
            not in (
                "naive",
                "legolink",
                "legolink0",
            )
        ):
            raise StrategyError(
                f"calibrate trains for naive, legolink:K or legolink0 (any placement, +top:N), "
                f"not {self.strategy}"
            )
        # held-out items too: with none, the run reports no measure of what it buys
        if min(self.link_tokens, self.items, self.held_out, self.steps, self.answer_tokens) < 1:
            raise CalibrationError(
                "link tokens, items, held-out items, steps and answer tokens must be >= 1"
            )
        if self.lr is not None and not 0 < self.lr <= 1:  # NaN too; past 1 Adam only diverges
            raise CalibrationError(
                f"the learning rate must be above 0 and at most 1, not {self.lr}"
            )

    @property
    def learning_rate(self) -> float:
        return default_lr(self.kind) if self.lr is None else self.lr


@dataclass(frozen=True)
class CalibrationReport:
    """What a run produced and what it bought in KL to prefill (held-out training items)."""

    calibration: Calibration | LinkLoRA
    config: CalibrateConfig
    train_minutes: float
    kl_before: float  # mean KL(prefill || strategy + initial link tokens / zero adapter)
    kl_without: float  # mean KL(prefill || strategy alone)
    kl_after: float  # mean KL(prefill || strategy + trained link tokens / adapter)
    losses: list[float] = field(default_factory=list)  # training KL per step

    @property
    def trained(self) -> str:
        return "adapter" if self.config.kind == "lora" else "link tokens"

    def to_json(self) -> dict[str, object]:
        return {
            "config": {**asdict(self.config), "lr": self.config.learning_rate},
            "train_minutes": self.train_minutes,
            "kl_held_out": {
                "strategy alone": self.kl_without,
                f"initial {self.trained}": self.kl_before,
                f"trained {self.trained}": self.kl_after,
            },
            "losses": self.losses,
        }


@dataclass(frozen=True)
class Example:
    """One training item, ready: the linked chunks (arranged, system prefix first), the new
    tokens (question, then the teacher's answer but its last token) and the teacher's
    log-probabilities [answer tokens, vocab] at the rows that predict the answer."""

    cache_ids: tuple[str, ...]
    new_ids: tuple[int, ...]
    teacher: torch.Tensor


def trainable_logits(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    new_ids: list[int],
    strategy: Strategy,
    vectors: torch.Tensor,
    keep: int,
) -> torch.Tensor:
    """`link`'s logits of the last `keep` new tokens [keep, vocab], differentiable in the
    link-token `vectors` [K, width] (see the module docstring); chunks as `link` takes them."""
    check_chunks(lm, chunks, strategy, len(new_ids))
    lengths = [c.num_tokens for c in chunks]
    slots = with_link_slots(lm, chunks, len(vectors))
    recompute = slots.computed(select_positions(strategy, lengths, lm.device), lengths)
    token_ids = torch.tensor([t for c in slots.chunks for t in c.token_ids], device=lm.device)
    L = len(token_ids)
    shape = (lm.num_layers, lm.num_kv_heads, L, lm.head_dim)
    keys = torch.zeros(shape, dtype=lm.dtype, device=lm.device)
    values = torch.zeros_like(keys)
    place_into(keys, values, slots.chunks, lm.inv_freq)
    positions = torch.cat((recompute, torch.arange(L, L + len(new_ids), device=lm.device)))
    ids = torch.cat((token_ids[recompute], torch.tensor(new_ids, device=lm.device)))
    inputs = soft_inputs(lm, ids, positions, slots, vectors)
    stale = torch.ones(L, dtype=torch.bool, device=lm.device)
    stale[recompute] = False  # their fresh copies come after the context
    cached = (torch.arange(L, device=lm.device)[None, :] < positions[:, None]) & stale[None, :]
    fresh = positions[None, :] <= positions[:, None]
    mask = additive_mask(torch.cat((cached, fresh), dim=1), lm.dtype)
    cache = build_cache([(k[None], v[None]) for k, v in zip(keys, values)], lm)
    logits, _ = forward(
        lm,
        ids[None],
        positions=positions[None],
        cache=cache,
        mask=mask,
        logits_to_keep=keep,
        embeds=inputs,
        grad=True,
    )
    return logits[0]


def initial_vectors(lm: LoadedModel, link_tokens: int) -> torch.Tensor:
    """Where training starts: K newlines' embeddings (a separator the model knows)."""
    newline = lm.tokenizer.encode("\n", add_special_tokens=False)[-1]
    ids = torch.full((1, link_tokens), newline, device=lm.device)
    return embed(lm, ids)[0].float().clone()


def distillation_kl(teacher: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student); teacher: log-probs, both [rows, vocab]."""
    student = F.log_softmax(student_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def _kept_teacher(
    path: Path, arranged: list[str], question_ids: list[int], answer_tokens: int
) -> Example | None:
    """A teacher kept by an earlier run, or None: none kept, or a damaged file (a cache, so it
    is computed again rather than stopping the run). Damaged includes a readable file of the
    wrong form: new ids that do not start with the question, a row count the answer cannot
    have, rows that are not log-probabilities (a file cut to another vocabulary)."""
    try:
        saved = load_file(str(path))
        ids, teacher = saved["new_ids"], saved["teacher"].float()
    except (OSError, SafetensorError, KeyError, ValueError):  # (missing: FileNotFoundError)
        return None
    new_ids = tuple(ids.tolist()) if ids.dim() == 1 and not ids.is_floating_point() else ()
    rows = teacher.shape[0] if teacher.dim() == 2 else 0
    if (
        new_ids[: len(question_ids)] != tuple(question_ids)
        or not 1 <= rows <= answer_tokens
        or len(new_ids) != len(question_ids) + rows - 1
        or not torch.allclose(teacher.exp().sum(-1), torch.ones(rows), atol=0.05)  # NaN: no
    ):
        return None
    return Example(tuple(arranged), new_ids, teacher)


def make_examples(
    engine: RagKVCache,
    items: list[dict[str, object]],
    strategy: Strategy,
    answer_tokens: int,
    on_item: Callable[[], None] | None = None,
    teachers: Path | None = None,
) -> list[Example]:
    """Cache each item's documents and take the teacher's answer and distributions.

    With `teachers`, a folder, each item's teacher is kept there (safetensors, float16
    log-probs, named by a hash of everything it depends on) and read back by a later run: a
    resumed run, or one with other training settings, skips the teacher's forwards."""
    lm, baseline = engine.lm, strategy.baseline
    out = []
    for item in items:
        documents = item["documents"]
        assert isinstance(documents, list)
        texts = [str(d["text"]) for d in documents]
        question = str(item["question"])
        cache_ids = engine.generate_context_cache(texts)
        arranged = baseline.arrange(cache_ids)
        prompt = engine.config.system_prompt
        key = json.dumps([lm.fingerprint, str(baseline), answer_tokens, prompt, question, texts])
        name = f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"
        kept = teachers / name if teachers is not None else None
        question_ids = engine.template.question_ids(lm.tokenizer, question)
        example = (
            _kept_teacher(kept, arranged, question_ids, answer_tokens) if kept is not None else None
        )
        if example is None:
            example = _teacher(engine, question, cache_ids, baseline, answer_tokens)
            if kept is not None:
                kept.parent.mkdir(parents=True, exist_ok=True)
                tensors = {
                    "teacher": example.teacher.half(),
                    "new_ids": torch.tensor(example.new_ids, dtype=torch.long),
                }
                write_atomically(kept, save_safetensors(tensors))
        out.append(example)
        if on_item:
            on_item()
    return out


def _teacher(
    engine: RagKVCache, question: str, cache_ids: list[str], baseline: Strategy, answer_tokens: int
) -> Example:
    """A plain prefill's greedy answer and its log-probs along it [answer tokens, vocab]."""
    lm = engine.lm
    answer = engine.generate(question, cache_ids, strategy=baseline, max_new_tokens=answer_tokens)
    assert isinstance(answer, Answer)
    tokens = list(answer.token_ids) or [lm.eos_ids[0]]
    arranged = baseline.arrange(cache_ids)
    prompt = engine.prompt_ids(question, arranged)
    ids = torch.tensor([prompt + tokens[:-1]], device=lm.device)
    logits, _ = forward(lm, ids, logits_to_keep=len(tokens))
    question_ids = engine.template.question_ids(lm.tokenizer, question)
    # rounded as a later run reads it back (`make_examples`): the same either way
    teacher = F.log_softmax(logits[0].float(), dim=-1).half().float()
    return Example(tuple(arranged), tuple(question_ids + tokens[:-1]), teacher)


Student = Callable[[list[ChunkKV], list[int], int], torch.Tensor]  # chunks, new ids, keep


def link_tokens_student(lm: LoadedModel, strategy: Strategy, vectors: torch.Tensor) -> Student:
    """The link with link tokens `vectors`: `trainable_logits`."""
    return lambda chunks, new_ids, keep: trainable_logits(
        lm, chunks, new_ids, strategy, vectors, keep
    )


def lora_student(lm: LoadedModel, strategy: Strategy) -> Student:
    """The naive link by the model as it is (with its adapter's layers in): `block_logits`."""
    return lambda chunks, new_ids, keep: block_logits(lm, chunks, new_ids, strategy, keep)


def example_kl(engine: RagKVCache, example: Example, student: Student) -> torch.Tensor:
    chunks = engine.store.get([engine.prefix_id, *example.cache_ids])
    logits = student(chunks, list(example.new_ids), len(example.teacher))
    return distillation_kl(example.teacher, logits)


def mean_kl(engine: RagKVCache, examples: list[Example], student: Student) -> float:
    with torch.no_grad():
        return sum(float(example_kl(engine, e, student)) for e in examples) / max(len(examples), 1)


def step_order(seed: int, step: int, count: int) -> int:
    """Which example step `step` trains on: each pass over the items in its own shuffle."""
    order = list(range(count))
    random.Random(seed * 1_000_003 + step // count).shuffle(order)
    return order[step % count]


def calibrate(
    lm: LoadedModel,
    config: CalibrateConfig,
    out: Path,
    resume: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    items: list[dict[str, object]] | None = None,
) -> CalibrationReport:
    """Train link tokens or a LoRA adapter for `lm` under `config`; OUT gets the checkpoint
    and the result (`resume`: from OUT's checkpoint, which must be this run's; without it, a
    checkpoint of this run stopped short of `config.steps` is refused: a forgotten --resume).
    An adapter's layers sit in `lm.model` while it trains (taken out at the end, whatever
    happens): nothing else may use `lm` meanwhile.

    `items` (the QA sets' JSON form: "documents" [{"text"}], "question") replace the train
    split's, e.g. questions over a user's own documents; the first `config.items` are trained
    on, the next `config.held_out` measured. `progress(phase, done, total)` reports the
    teacher pass, every step and ("resume") the step a resumed run goes on from.
    """
    strategy = Strategy.parse(config.strategy)
    # the training chunks live in a scratch store of their own, never in the user's
    scratch = RagKVCache(EngineConfig(), lm=lm, store=MemoryStore())
    needed = config.items + config.held_out
    if items is None and needed > CELLS * MAX_REPEATS:  # (made for minutes, then days of work)
        raise CalibrationError(
            f"the train split holds at most {CELLS * MAX_REPEATS} items of a context size, "
            f"not {config.items} + {config.held_out} held out: ask fewer, or give --items-file"
        )
    if items is None:
        repeats = math.ceil(needed / CELLS)
        items = [i for i in make_split("train", repeats) if _context(i) == config.context]
    if len(items) < needed:
        raise CalibrationError(
            f"{len(items)} training items of {config.context}; "
            f"asked for {config.items} + {config.held_out} held out"
        )
    chosen = items[:needed]
    trained_on = items_digest(chosen)
    checkpoint = out / CHECKPOINT
    if resume:  # refused at once, before the teacher pass
        at = _check_checkpoint(checkpoint, config, lm, trained_on)
        if at > config.steps:  # its result would say fewer steps than it took
            raise CalibrationError(
                f"{checkpoint} is at step {at}, past --steps {config.steps}: resume with "
                f"--steps {at} or more"
            )
    elif checkpoint.exists():  # this run, stopped short: a forgotten --resume lost its steps
        try:
            at = _check_checkpoint(checkpoint, config, lm, trained_on)
        except CalibrationError:  # another run's (other settings): trained afresh, teachers
            at = config.steps  # reused, as the docs say of further runs in the same OUT
        if at < config.steps:
            raise CalibrationError(
                f"{checkpoint} holds this run stopped at step {at} of {config.steps}: go on "
                "from it with --resume, or delete it to train afresh"
            )
    out.mkdir(parents=True, exist_ok=True)
    done = 0

    def ticked() -> None:
        nonlocal done
        done += 1
        if progress:
            progress("teacher", done, len(chosen))

    teachers = out / TEACHERS
    examples = make_examples(scratch, chosen, strategy, config.answer_tokens, ticked, teachers)
    train, held = examples[: config.items], examples[config.items :]
    params: dict[str, torch.Tensor]
    if config.kind == "lora":
        with torch.random.fork_rng():  # A's random start, a function of the seed
            torch.manual_seed(config.seed)
            params = dict(add_lora(lm.model, config.rank, 2 * config.rank))
        student = lora_student(lm, strategy)
        plain = initial = student  # B = 0: the adapter starts as the base model
    else:
        params = {"vectors": initial_vectors(lm, config.link_tokens).requires_grad_(True)}
        student = link_tokens_student(lm, strategy, params["vectors"])
        plain = link_tokens_student(lm, strategy, params["vectors"][:0])
        initial = link_tokens_student(lm, strategy, initial_vectors(lm, config.link_tokens))
    try:
        optimizer = torch.optim.AdamW(
            list(params.values()), lr=config.learning_rate, weight_decay=0.0
        )
        # before a checkpoint is read: a resumed adapter is no longer the model alone
        kl_without = mean_kl(scratch, held, plain)
        kl_before = kl_without if config.kind == "lora" else mean_kl(scratch, held, initial)
        start_step, losses, earlier_s = 0, list[float](), 0.0
        if resume:
            start_step, losses, earlier_s = _load_checkpoint(checkpoint, params, optimizer)
            if progress:
                progress("resume", start_step, config.steps)
        began, trained_s = time.perf_counter(), earlier_s
        for step in range(start_step, config.steps):
            example = train[step_order(config.seed, step, len(train))]
            loss = example_kl(scratch, example, student)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]) or not all(
                bool(torch.isfinite(p.detach()).all()) for p in params.values()
            ):  # before a checkpoint keeps it: the last one is the last finite step
                raise CalibrationError(
                    f"training diverged at step {step + 1} (loss {losses[-1]}): train again "
                    f"with a lower --lr than {config.learning_rate:g}"
                )
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                trained_s = earlier_s + time.perf_counter() - began
                _save_checkpoint(
                    checkpoint, config, lm, params, optimizer, step + 1, losses, trained_on,
                    trained_s,
                )  # fmt: skip
            if progress:
                progress("train", step + 1, config.steps)
        # the training of every session the result's steps were taken in, not this one's alone
        # (as the last step's checkpoint keeps it)
        minutes = trained_s / 60
        kl_after = mean_kl(scratch, held, student)
        recent = losses[-len(train) :] or [math.nan]
        loss_now = sum(recent) / len(recent)
        result: Calibration | LinkLoRA
        if config.kind == "lora":
            tensors = lora_tensors(lm.model)
            result = LinkLoRA(
                tensors,
                config.rank,
                2 * config.rank,
                TARGETS,
                lm.fingerprint,
                str(strategy),
                config.steps,
                loss_now,
            )
            result.save(out / LORA_RESULT)
        else:
            result = Calibration(
                params["vectors"].detach().clone(),
                lm.fingerprint,
                scratch.doc_settings.key(),
                str(strategy),
                config.steps,
                loss_now,
            )
            result.save(out / RESULT)
    finally:
        if config.kind == "lora":  # the caller's model is the base model again
            remove_lora(lm.model, merge=False)
    report = CalibrationReport(result, config, minutes, kl_before, kl_without, kl_after, losses)
    (out / "calibration.json").write_text(report_json.dumps(report.to_json(), indent=2) + "\n")
    plot_training(report, out / "calibration.png")
    return report


def plot_training(report: CalibrationReport, path: Path) -> None:
    """The training KL per step (and its running mean over one pass), with the held-out KL
    of the strategy alone, the untrained and the trained link tokens as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = report.losses
    window = max(1, min(report.config.items, len(losses)))
    running = [
        sum(losses[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(losses))
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, color="0.8", linewidth=0.8, label="training item, per step")
    ax.plot(running, color="C0", label=f"training, mean of the last {window} steps")
    for value, label, color in (
        (report.kl_without, f"held out: {report.config.strategy} alone", "C3"),
        (report.kl_before, f"held out: untrained {report.trained}", "C1"),
        (report.kl_after, f"held out: trained {report.trained}", "C2"),
    ):
        ax.axhline(value, color=color, linestyle="--", label=f"{label} ({value:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(prefill || linked), nats per answer token")
    shape = (
        f"a rank-{report.config.rank} LoRA adapter"
        if report.config.kind == "lora"
        else f"{report.config.link_tokens} link tokens"
    )
    ax.set_title(f"link calibration: {shape}, {report.train_minutes:.1f} min")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _context(item: dict[str, object]) -> str:
    meta = item["meta"]
    assert isinstance(meta, dict)
    return str(meta["context"])


def _resumable(config: dict[str, object]) -> dict[str, object]:
    """The settings a resumed run must share with the checkpoint's (more steps may follow);
    the learning rate as used (the default given by name is the default)."""
    settings = {k: v for k, v in config.items() if k not in ("steps", "checkpoint_every")}
    if settings.get("lr") is None:
        settings["lr"] = default_lr(str(settings.get("kind")))
    return settings


def items_digest(items: list[dict[str, object]]) -> str:
    """What a run trains and measures on (its items as chosen): a resumed run must have the
    same (an --items-file added, dropped or edited was trained on unnoticed)."""
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()


def checkpoint_step(path: Path) -> int:
    """The step the checkpoint at `path` holds (what an interrupted run can resume from)."""
    return _checkpoint_header(path)[2]


def _checkpoint_header(path: Path) -> tuple[dict[str, str], dict[str, object], int]:
    """A checkpoint's metadata, the settings of the run that wrote it, and its step; a
    missing or damaged one is a CalibrationError."""
    from safetensors import safe_open

    if not path.is_file():
        raise CalibrationError(
            f"no checkpoint to resume in {path.parent} (it has no {path.name}): train there "
            "without --resume, or name the folder the interrupted run wrote (--out)"
        )
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        settings = json.loads(meta.get("config", "{}"))
        if not isinstance(settings, dict):  # valid JSON, but not the settings a run writes
            raise ValueError(f"its settings are {type(settings).__name__}, not an object")
        step = int(meta["step"])
    except (OSError, SafetensorError, ValueError, KeyError, RecursionError) as e:  # (JSON too)
        raise CalibrationError(
            f"{path} is damaged ({type(e).__name__}); train afresh in another folder"
        ) from None
    return meta, settings, step


def _check_checkpoint(path: Path, config: CalibrateConfig, lm: LoadedModel, items: str) -> int:
    """The step of a checkpoint a run may resume from: the same settings, model and items.
    Read before the teacher pass, so a refusal comes at once."""
    meta, settings, step = _checkpoint_header(path)
    ours, theirs = _resumable(asdict(config)), _resumable(settings)
    if ours != theirs:
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise CalibrationError(
            f"{path} was written by a run with other settings ({', '.join(differ)}: "
            f"{', '.join(f'{k}={theirs.get(k)!r}' for k in differ)} there); resume with the "
            "same ones, or train afresh in another folder"
        )
    if meta.get("fingerprint") != lm.fingerprint:
        raise CalibrationError(
            f"{path} was trained on model {meta.get('fingerprint')}, not on the loaded "
            f"{lm.fingerprint}; train afresh in another folder"
        )
    if meta.get("items") != items:
        raise CalibrationError(
            f"{path} was trained on other items (another --items-file, or none"
            + ("; or by a version that recorded none" if meta.get("items") is None else "")
            + "); resume with the same ones, or train afresh in another folder"
        )
    return step


def _save_checkpoint(
    path: Path,
    config: CalibrateConfig,
    lm: LoadedModel,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    losses: list[float],
    items: str,
    trained_s: float,
) -> None:
    """The parameters and AdamW's moments by name (`NAME`, `NAME/exp_avg`, ...), safetensors,
    with the seconds the steps it holds took to train (over every session, for the report)."""
    tensors = {}
    for name, param in params.items():
        state = optimizer.state[param]
        tensors[name] = param.detach().contiguous()
        tensors[f"{name}/exp_avg"] = state["exp_avg"].contiguous()
        tensors[f"{name}/exp_avg_sq"] = state["exp_avg_sq"].contiguous()
        tensors[f"{name}/step"] = torch.as_tensor(state["step"], dtype=torch.float64).reshape(1)
    meta = {
        "config": json.dumps(asdict(config)),
        "fingerprint": lm.fingerprint,
        "step": str(step),
        "losses": json.dumps(losses),
        "items": items,
        "trained_s": repr(trained_s),
    }
    write_atomically(path, save_safetensors(tensors, metadata=meta))


def _load_checkpoint(
    path: Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[int, list[float], float]:
    """The step, losses and training seconds a checkpoint (`_check_checkpoint`ed) holds; its
    parameters and AdamW's moments loaded into `params` and `optimizer`."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        step, losses = int(meta["step"]), json.loads(meta["losses"])
        if not isinstance(losses, list) or not all(isinstance(x, int | float) for x in losses):
            raise ValueError("its losses are not a list of numbers")
        trained_s = float(meta.get("trained_s", "0"))  # (none kept before: counted from here)
        if not 0 <= trained_s < math.inf:
            raise ValueError(f"its training time is {trained_s}")
    except (OSError, SafetensorError, ValueError, KeyError, RecursionError) as e:  # (JSON too)
        raise CalibrationError(
            f"{path} is damaged ({type(e).__name__}); train afresh in another folder"
        ) from None
    if set(tensors) != {
        f"{n}{s}" for n in params for s in ("", "/exp_avg", "/exp_avg_sq", "/step")
    } or any(tensors[name].shape != param.shape for name, param in params.items()):
        raise CalibrationError(f"{path} does not hold this run's parameters; train afresh")
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        # no step saves one (divergence stops before the checkpoint): written by hand or broken
        raise CalibrationError(f"{path} holds values that are not finite; train afresh")
    for name, param in params.items():
        with torch.no_grad():
            param.copy_(tensors[name])
        optimizer.state[param] = {
            "step": tensors[f"{name}/step"][0].to(torch.float32),
            "exp_avg": tensors[f"{name}/exp_avg"],
            "exp_avg_sq": tensors[f"{name}/exp_avg_sq"],
        }
    return step, losses, trained_s
