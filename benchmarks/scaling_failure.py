#!/usr/bin/env python
"""Kill -9 one rank of a large one-host job and check that every survivor fails naming it.

The dying rank runs its communicator in a forked child that SIGKILLs itself after 20 small
allreduces (tests/transport/test_peer_failure.py's worker), so the job itself completes and returns
what each survivor saw. CI runs this at 16 ranks (tests/transport/test_scaling_transport.py); this
script runs the larger sizes.

    python benchmarks/scaling_failure.py --ranks 32 --transport tcp
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "transport"))


def main() -> int:
    from test_peer_failure import _dying_rank_worker, _names_rank

    import hora

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--victim", type=int, default=13)
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp")
    args = parser.parse_args()
    started = time.time()
    reports = hora.run(_dying_rank_worker, args=(args.victim, "sigkill", 16, 20, args.transport), np=args.ranks,
                       env={"HORA_TRANSPORT_TIMEOUT": "30"})
    survivors = [r for r in reports if r["rank"] != args.victim]
    named = [r for r in survivors if r["raised"] and r.get("is_peer_failure") and r["failed_rank"] == args.victim
             and _names_rank(r["message"], args.victim)]
    slowest = max((r.get("seconds_since_last_ok", float("inf")) for r in survivors), default=0.0)
    print(f"{args.transport}, {args.ranks} ranks, rank {args.victim} killed: {len(named)}/{len(survivors)} survivors "
          f"raised PeerFailureError naming it; slowest detection {slowest:.2f} s; job {time.time() - started:.1f} s")
    print("e.g.:", survivors[0].get("message", "")[:200])
    return 0 if len(named) == len(survivors) else 1


if __name__ == "__main__":
    sys.exit(main())
