"""Log lines that name the rank and role that wrote them; only rank 0 logs below warnings."""

from __future__ import annotations

import logging
import os


def launcher_rank() -> int:
    """This process's rank as the launcher announced it, before Fabric starts: torchrun and
    `fabric run` set RANK; Fabric's own launcher sets LOCAL_RANK in the ranks it starts."""
    return int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)


def setup(rank: int, role: str | None = None) -> None:
    label = f"rank {rank} {role}" if role else f"rank {rank}"
    logging.basicConfig(
        format=f"[{label}] %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING,
        force=True,
    )
    # Fabric gives its logger a handler of its own at INFO when nothing is configured; route
    # its lines through the labelled handler and let the level above decide.
    logger = logging.getLogger("lightning_fabric")
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    logging.captureWarnings(True)  # Python warnings get the label too
