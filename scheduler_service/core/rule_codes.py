"""The reason rules' codes and the layout of the plan-wide facts the classifier reads.

A waiting request's reason is the first rule of :data:`REASON_RULES` that is on and
holds for it (``behind`` when none does); the classifier (``kernels.ops().reason_codes``)
reads which rules are on, and each rule's own number, from one float64 array laid out as
:data:`RULE_SCALAR` says.  Module-level ints: the compiled kernels read them as constants.
"""

from __future__ import annotations

import numpy as np

from .plan import CODES

__all__ = [
    "REASON_RULES", "REASON_VALUE", "RULES_LEN", "RULE_SCALAR", "RULE_SKIP", "RULE_STARVE", "reason_tokens",
    "seqs_rules",
]

# Code indices (into :data:`.plan.CODES`) of the rules the classifier applies.
RC_MAX_NUM_SEQS, RC_TOKEN_BUDGET, RC_TIME_BUDGET, RC_KV, RC_KV_WATERMARK, RC_GIVEN_UP, RC_EXPIRED, RC_AHEAD, \
    RC_LATE, RC_CLASS_SIT_OUT, RC_CLASS_RESCUE, RC_CLASS_RESERVE, RC_NOT_CHOSEN, RC_BEHIND = (
        CODES.index(c) for c in ("max_num_seqs", "token_budget", "time_budget", "kv", "kv_watermark", "given_up",
                                 "expired", "ahead", "late", "class_sit_out", "class_rescue", "class_reserve",
                                 "not_chosen", "behind"))
#: The rules in the order they are tried: a waiting request's reason is the first that
#: holds (after its own verdict, a rejection or a preemption), ``behind`` when none does.
REASON_RULES = (RC_MAX_NUM_SEQS, RC_TOKEN_BUDGET, RC_KV, RC_KV_WATERMARK, RC_CLASS_RESERVE, RC_GIVEN_UP,
                RC_EXPIRED, RC_CLASS_RESCUE, RC_LATE, RC_AHEAD, RC_CLASS_SIT_OUT, RC_NOT_CHOSEN, RC_TIME_BUDGET)
#: What a code's value is, per code: 0 the rule's own number (``scalar``), 1 the request's
#: slack in ms, 2 its class (priority), 3 its KV tokens.
REASON_VALUE = np.zeros(len(CODES), dtype=np.int8)
REASON_VALUE[[CODES.index(c) for c in ("given_up", "expired", "ahead", "late", "ttft_expired", "e2e_expired",
                                        "ttft_unreachable", "e2e_unreachable")]] = 1
REASON_VALUE[CODES.index("class_sit_out")] = 2
REASON_VALUE[CODES.index("preempted")] = 3
REASON_VALUE.flags.writeable = False

#: Where the classifier reads the plan-wide facts in its one ``rules`` array (float64):
#: ``rules[c]`` nonzero where rule ``c`` is on, ``rules[RULE_SCALAR + c]`` the rule's own
#: number (but ``behind``'s, counted, and the one passed apart), then the starvation bound
#: and the decode skip.
RULE_SCALAR = len(CODES)
RULE_STARVE = 2 * len(CODES)
RULE_SKIP = RULE_STARVE + 1
RULES_LEN = RULE_SKIP + 1


def seqs_rules(rules: np.ndarray, served: int, max_seqs: int) -> np.ndarray:
    """A copy of ``rules`` with the ``max_num_seqs`` rule on (its number ``max_seqs``)
    when a plan serving ``served`` requests reaches it (``rules`` may be shared and
    read-only; plain enough for the compiled kernel to compile as it is)."""
    own = rules.copy()
    if served >= max_seqs:
        own[RC_MAX_NUM_SEQS] = 1.0
        own[RULE_SCALAR + RC_MAX_NUM_SEQS] = max_seqs
    return own


def reason_tokens(n: int, dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray) -> np.ndarray:
    """Tokens per row of a plan: one for each of ``dec_rows`` (decodes), ``pre_toks[j]``
    for row ``pre_rows[j]``."""
    got = np.zeros(n, dtype=np.int64)
    got[dec_rows] = 1
    got[pre_rows] = pre_toks
    return got
