"""What a trainer starting on a node that kept running asks of its restore (generic mode).

``tierfs wait`` is run where a trainer starts (README "tierfs wait"). On a node
whose daemon started with the job, the restore at the mount is that trainer's
restore. On a node whose daemon kept running while the job restarted (a
scheduler restarts every worker after one node's loss, or the trainers
crashed and restart on the same nodes), the last restore settled before the
job wrote the steps it holds now: that result is stale, and the trainers of
the new incarnation must get one agreed step from a new round (#16 sixth trial
N4: survivors printed the result of their mount-time restore, ``nothing to
restore`` or an older step, while the restarted node resumed from another).

So the wait opens ``.tierfs/restart`` for writing, and the daemon decides with
:func:`trainer_start_action` (pure):

* a restore runs here: the trainer waits for it; it is this trainer's restore
  (:data:`JOIN`), so steps newer than the agreed one are abandoned at its end
  even when the coordinator summoned this node;
* the last restore settled after every step this node sealed and no trainer
  started from it yet, or one did less than :data:`SAME_START` seconds ago
  (the other local ranks of the same start): it stands (:data:`CURRENT`); if
  this node was summoned into it and holds steps newer than the agreed one,
  they are abandoned now (the trainer restarts from the agreed step);
* this node sealed a step newer than the restored one after the restore
  settled (the job went on and restarted since), or a trainer started from
  that restore longer ago (this is a restart: another node may hold newer
  steps, #16 seventh trial C): a new round starts with this node as a
  restarted node (:data:`ROUND`); the coordinator summons the others and a
  node whose trainer starts later joins it (:data:`JOIN`) or finds it
  settled and not handed to a trainer yet (:data:`CURRENT`), so one
  incarnation gets one round; a failed restore that a trainer was told of
  is retried the same way;
* anything else (protocol mode, where ``replicator.yaml`` is the trainer's
  signal; no job; a failed restore no trainer was told of yet, which the
  wait reports): :data:`NOTHING`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tierfs.node.jobstate import RESTORING_STATES

__all__ = [
    "CURRENT",
    "JOIN",
    "NOTHING",
    "ROUND",
    "SAME_START",
    "TrainerStart",
    "trainer_start_action",
]

#: what a trainer start does (see the module docstring)
JOIN, CURRENT, ROUND, NOTHING = "join", "current", "round", "nothing"


@dataclass(frozen=True)
class TrainerStart:
    """The decision for one trainer start.

    Attributes:
        action: :data:`JOIN`, :data:`CURRENT`, :data:`ROUND` or :data:`NOTHING`.
        drop_after: steps newer than this one are abandoned on this node now
            (:data:`CURRENT` after a summoned round); None: nothing to drop now.
        why: one line for the log and ``.tierfs/restart``.
    """

    action: str
    drop_after: int | None
    why: str


#: seconds after a trainer start during which further trainer starts on the node are
#: the same start (the other local ranks of one torchrun or one Ray worker group):
#: they get the same result; a later start is a restart of the trainer
SAME_START = 60.0


def trainer_start_action(
    mode: str,
    running: bool,
    last: Mapping[str, Any],
    own_seals: Iterable[tuple[int, float]],
    handed_ago: float | None = None,
    same_start: float = SAME_START,
    known: Collection[int] = (),
) -> TrainerStart:
    """Decide what a trainer start does (pure; see the module docstring).

    Args:
        mode: the job's mode (``generic``, ``protocol``, ``none``).
        running: a restore runs on this node now (pending, planning or fetching).
        last: the restore state (``JobState.restore_state``): ``state``, ``step``
            (None: nothing restored), ``at`` (Unix seconds it settled),
            ``summoned``.
        own_seals: (step, seal time in Unix seconds) of this node's own parts of
            the job held now.
        handed_ago: seconds since the trainer start that got ``last`` as its result
            (None: no trainer start got it yet).
        same_start: seconds (:data:`SAME_START`) within which another trainer start
            is the same start (another local rank).
        known: the steps this node held or was sealing when the trainer start that
            got ``last`` came: their seals are not "written since" (#16 eighth trial
            D: a seal pending at the first local rank's start completed before the
            second's, which opened a second round).
    """
    if mode != "generic":
        return TrainerStart(NOTHING, None, f"{mode} mode: the trainer's control file restores")
    state = last.get("state")
    if running or state in RESTORING_STATES:
        # (also one about to start: a daemon that just mounted shows ``pending``)
        return TrainerStart(JOIN, None, "a restore runs on this node: the trainer waits for it")
    restart = handed_ago is not None and handed_ago >= same_start
    if state == "failed" and restart:
        return TrainerStart(
            ROUND, None, "the last restore failed and a trainer was told: a new restore round"
        )
    if state != "done":
        return TrainerStart(NOTHING, None, f"the last restore is {state or 'unknown'}")
    step = last.get("step") or 0
    settled = float(last.get("at") or 0.0)
    newer = [(s, t) for s, t in own_seals if s > step]
    later = [s for s, t in newer if t >= settled and s not in known]
    what = f"step {step}" if step else "nothing"
    if later:
        return TrainerStart(
            ROUND,
            None,
            f"the last restore ({what}) settled before this node sealed step "
            f"{max(later)}: a new restore round for the restarted trainer",
        )
    if restart:
        # another node may hold newer steps: every node of a restart takes part in one
        # round, or a node that answered at once resumes apart (#16 seventh trial C)
        return TrainerStart(
            ROUND,
            None,
            f"a trainer started from the last restore ({what}) {handed_ago:.0f} s ago: "
            "a new restore round for the restarted trainer",
        )
    if newer and step and last.get("summoned"):
        return TrainerStart(
            CURRENT,
            step,
            f"the round this node was summoned into restored step {step}: its newer "
            f"step(s) {sorted(s for s, _ in newer)} are abandoned as the trainer restarts",
        )
    return TrainerStart(CURRENT, None, "the last restore stands")
