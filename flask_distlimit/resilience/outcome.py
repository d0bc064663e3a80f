"""What a guarded storage call decided: :class:`Outcome`, and the failure policies' answers.

:meth:`Guard.evaluate <flask_distlimit.resilience.guard.Guard.evaluate>` answers with an
:class:`Outcome`; the policies that know nothing of the checks share one frozen outcome each.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Final

from flask_distlimit.core.decision import Evaluation
from flask_distlimit.frozen import slot_init


@slot_init
@dataclass(frozen=True, slots=True)
class Outcome:
    """What the guarded storage call decided.

    - ``evaluation``: the decisions (from the storage, or from the local fallback when degraded);
      ``None`` when the storage failed under policy ``open`` or ``closed``.
    - ``degraded``: the storage failed; the answer comes from the failure policy.
    - ``unavailable``: policy ``closed`` and the storage failed: answer 503.
    - ``busy``: (with ``unavailable``) this process's calls queued past their budget
      (:class:`~flask_distlimit.errors.StorageBusy`): answer 503, ``Retry-After: 1``.
    """

    evaluation: Evaluation | None
    _: KW_ONLY
    degraded: bool = False
    unavailable: bool = False
    busy: bool = False


#: Policy ``"open"`` (or nothing known about any check): allow, marked degraded.
OPEN_OUTCOME: Final = Outcome(None, degraded=True)
#: Policy ``"closed"``: a 503.
CLOSED_OUTCOME: Final = Outcome(None, degraded=True, unavailable=True)
#: This process's load, whatever the policy (never unlimited admission): a 503 to retry soon.
BUSY_OUTCOME: Final = Outcome(None, degraded=True, unavailable=True, busy=True)
