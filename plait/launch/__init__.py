"""Launching ranks: local spawning and pools (:mod:`~plait.launch.pool`), one attempt of
``plait run`` (:mod:`~plait.launch.attempt`), the job and its restarts
(:mod:`~plait.launch.job`), how a rank starts (:mod:`~plait.launch.rank_entry`), the
rendezvous checks (:mod:`~plait.launch.rendezvous`), dying with the launcher
(:mod:`~plait.launch.lifeline`) and the post-mortem reader (:mod:`~plait.launch.doctor`)."""

from plait.launch.pool import RankError, RankExited, RankPool, RankTimeout, spawn

__all__ = ["RankError", "RankExited", "RankPool", "RankTimeout", "spawn"]
