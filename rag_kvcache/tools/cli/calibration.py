"""`calibrate`: train the model's link tokens and keep them in the store (`+calibrated`)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from rich.console import Console

from rag_kvcache.tools.cli.common import engine_options


def add_parsers(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="train link tokens that help the model read independently encoded chunks",
        description=(
            "Distil a plain prefill's next-token distributions into a few link tokens placed "
            "after every document chunk (the model stays frozen), on the project's own "
            "training documents or on --items-file; keep the result in the store, where "
            "every `+calibrated` strategy uses it (a LoRA adapter, --kind lora: where "
            "`--lora store` loads it). Resumable (--resume)."
        ),
    )
    # defaults are CalibrateConfig's (None here: this module stays light for --help)
    calibrate.add_argument("--strategy", help="the link it repairs (default naive+reversed)")
    calibrate.add_argument(
        "--kind",
        choices=["tokens", "lora"],
        help="link tokens after every chunk, the model frozen (default), or a LoRA adapter "
        "trained on block-wise attention (answer with it: --lora store)",
    )
    calibrate.add_argument("--link-tokens", type=int, help="per document chunk (default 4)")
    calibrate.add_argument("--rank", type=int, help="the LoRA adapter's rank (default 8)")
    calibrate.add_argument("--items", type=int, help="items trained on (default 64)")
    calibrate.add_argument("--held-out", type=int, help="items measured only (default 16)")
    calibrate.add_argument("--context", choices=["1K", "2K", "4K"], help="(default 1K)")
    calibrate.add_argument("--steps", type=int, help="(default 300)")
    calibrate.add_argument(
        "--lr", type=float, help="(default 0.005 for link tokens, 0.0005 for an adapter)"
    )
    calibrate.add_argument("--answer-tokens", type=int, help="distilled per item (default 16)")
    calibrate.add_argument("--seed", type=int)
    calibrate.add_argument(
        "--items-file", type=Path, default=None, help="JSONL QA items instead of the train split"
    )
    calibrate.add_argument("--out", type=Path, default=Path("calibration"))
    calibrate.add_argument("--resume", action="store_true", help="go on from OUT's checkpoint")
    calibrate.add_argument(
        "--no-install", action="store_true", help="write OUT only; leave the store as it is"
    )
    engine_options(calibrate)
    calibrate.set_defaults(run=calibrate_command)


def calibrate_command(args: argparse.Namespace, console: Console) -> int:
    from dataclasses import fields

    from rich.progress import Progress, TaskID

    from rag_kvcache.config import STORED_LORA
    from rag_kvcache.errors import CalibrationError
    from rag_kvcache.model.loading import RANDOM_PREFIX
    from rag_kvcache.model.lora import LinkLoRA
    from rag_kvcache.tools.calibrate import (
        CHECKPOINT,
        LORA_RESULT,
        CalibrateConfig,
        calibrate,
        checkpoint_step,
    )
    from rag_kvcache.tools.cli.common import open_engine
    from rag_kvcache.tools.eval.dataset import load_dataset

    given = {f.name: getattr(args, f.name, None) for f in fields(CalibrateConfig)}
    config = CalibrateConfig(**{k: v for k, v in given.items() if v is not None})
    items: list[dict[str, object]] | None = None
    if args.items_file is not None:
        items = [
            {"question": i.question, "documents": [{"text": t} for t in i.documents]}
            for i in load_dataset(args.items_file)
        ]
    if config.kind == "lora" and args.lora:
        console.print("[red]a LoRA adapter trains on the base model: drop --lora")
        return 2
    if config.kind == "lora" and str(args.model or "").startswith(RANDOM_PREFIX):
        # (it trained, and kept in the store an adapter no answer could then load)
        console.print("[red]random-weight models take no LoRA adapter: train link tokens")
        return 2
    # --no-install: no store is touched, but for the adapter it keeps (`--lora store`)
    stored_lora = args.lora == STORED_LORA
    engine = open_engine(
        args,
        console,
        existing=args.no_install and stored_lora,
        in_memory=args.no_install and not stored_lora,
    )
    with Progress(console=console) as progress:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: int, total: int) -> None:
            if phase == "resume":  # (said once the checkpoint is checked to be this run's)
                where = args.out / CHECKPOINT
                console.print(f"resuming from step {done} of {where}", highlight=False)
                return
            if phase not in tasks:
                label = "teacher answers" if phase == "teacher" else "training steps"
                tasks[phase] = progress.add_task(label, total=total)
            progress.update(tasks[phase], completed=done)
            if not console.is_terminal and (done % 10 == 0 or done == total):  # a log: lines
                console.print(f"calibrate: {phase} {done}/{total}", highlight=False)

        try:
            result = calibrate(engine.lm, config, args.out, args.resume, report, items)
        except KeyboardInterrupt:  # what a --resume will go on from (steps after it are lost)
            checkpoint = args.out / CHECKPOINT
            with contextlib.suppress(CalibrationError):  # (none, or damaged: nothing to say)
                step = checkpoint_step(checkpoint)
                console.print(f"{checkpoint} holds step {step} (--resume)", highlight=False)
            raise
    console.print(
        f"KL to prefill on {config.held_out} held-out items: {result.kl_without:.4f} with "
        f"{config.strategy} alone, {result.kl_before:.4f} with the untrained "
        f"{result.trained}, {result.kl_after:.4f} trained "
        f"({result.train_minutes:.1f} min of training)",
        highlight=False,
    )
    if not result.kl_after < result.kl_without:  # (NaN too: nothing bought)
        console.print(
            f"[yellow]the trained {result.trained} leave the answers no closer to prefill's "
            f"than {config.strategy} alone ({result.kl_after:.4f} against "
            f"{result.kl_without:.4f}): `+calibrated` will not help; train longer "
            "(--steps, --items) or with another --lr",
            highlight=False,
        )
    if isinstance(result.calibration, LinkLoRA):
        console.print(
            f"wrote {args.out}/{LORA_RESULT} and calibration.json", markup=False, highlight=False
        )
        use = f"--lora {args.out}/{LORA_RESULT}"
        if not args.no_install:
            adapter = result.calibration.to_bytes()
            checksum = engine.store.put_adapter(engine.lm.fingerprint, adapter)
            console.print(
                f"kept in the store {args.store} for {engine.lm.name} (sha256 {checksum[:12]})",
                markup=False,
                highlight=False,
            )
            use = f"--lora store (or {use})"
        console.print(
            f"answer with the adapted model: {use}; its chunks are its own, encoded anew",
            markup=False,
            highlight=False,
        )
        return 0
    console.print(
        f"wrote {args.out}/calibration.safetensors and calibration.json",
        markup=False,
        highlight=False,
    )
    if not args.no_install:
        checksum = engine.set_calibration(result.calibration)
        console.print(
            f"kept in the store {args.store} for {engine.lm.name} (sha256 {checksum[:12]}); "
            "answer with a `+calibrated` strategy, e.g. "
            f"`{config.strategy}+calibrated`",
            markup=False,
            highlight=False,
        )
    return 0
