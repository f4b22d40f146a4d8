"""The live line under a notebook cell while a job trains: epoch, samples/s, loss."""

from __future__ import annotations

import html
import time
from typing import Any

__all__ = ["ProgressLine"]


class ProgressLine:
    """The live line under the cell: epoch, samples/s, loss, validation metric."""

    def __init__(self, job: Any):  # the nbdist.job.Job it shows (a type import would be a ring)
        self.job = job
        self.handle = None
        self._last: dict[str, Any] | None = None  # the summary shown last
        try:
            from IPython import get_ipython
            from IPython.display import display

            shell = get_ipython()
            # Only in a kernel (JupyterLab, nbclient): a terminal would print every update.
            if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
                self.handle = display(self, display_id=True)
        except ImportError:
            pass

    def update(self, final: bool = False) -> None:
        if self.handle is None:
            return
        text = self.summary()
        if text != self._last or final:
            self._last = text
            self.handle.update(self)

    def summary(self) -> dict[str, Any]:
        job = self.job
        records = job.live.records
        epochs = [r["values"] for r in records if r["kind"] == "epoch"]
        latest: dict[int, dict[str, Any]] = {}
        for r in records:
            if r["kind"] == "train":
                latest[r["rank"]] = r["values"]
        speed = sum(v.get("samples_per_s") or 0.0 for v in latest.values())
        losses = [v["loss"] for v in latest.values() if v.get("loss") is not None]
        state = {
            "status": job.status,
            "epoch": epochs[-1]["epoch"] if epochs else 0,
            "epochs": job.options.epochs,
            "samples_per_s": speed,
            "loss": sum(losses) / len(losses) if losses else None,
            "seconds": (job.ended or time.time()) - job.started,
        }
        if epochs:
            state.update({k: v for k, v in epochs[-1].items() if k.startswith("val_")})
        return state

    def _text(self) -> str:
        s = self.summary()
        parts = [f"nbdist {s['status']}", f"epoch {s['epoch']}/{s['epochs']}", f"{s['samples_per_s']:.0f} samples/s"]
        if s["loss"] is not None:
            parts.append(f"loss {s['loss']:.4f}")
        parts += [f"{k} {v:.4f}" for k, v in s.items() if k.startswith("val_") and v is not None]
        parts.append(f"{s['seconds']:.1f} s")
        if self.job.error is not None:
            parts.append(f"error: {self.job.error}")
        return " | ".join(parts)

    def __repr__(self) -> str:
        return self._text()

    def _repr_html_(self) -> str:
        s = self.summary()
        return (
            f'<div><progress value="{s["epoch"]}" max="{s["epochs"]}" style="width:16em"></progress> '
            f"<code>{html.escape(self._text())}</code></div>"
        )
