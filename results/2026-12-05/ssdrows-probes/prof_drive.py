"""Profile one phase of bench lmcache-mp's driver: cProfile on every Python thread (call counts)."""

import cProfile
import io
import json
import pstats
import sys
import threading

profs = []
_run = threading.Thread.run


def run(self):
    p = cProfile.Profile()
    profs.append((self.name, p))
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()


threading.Thread.run = run
from kvoffload.bench.peers.lmcache_mp import drive  # noqa: E402

config = json.loads(sys.argv[1])
main = cProfile.Profile()
main.enable()
out = drive(config)
main.disable()
print(json.dumps(out))
st = pstats.Stats(main)
for name, p in profs:
    try:
        st.add(p)
    except Exception as exc:  # a thread still running
        print("skip", name, exc, file=sys.stderr)
st.dump_stats(sys.argv[2])
s = io.StringIO()
pstats.Stats(sys.argv[2], stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue()[:8000], file=sys.stderr)
print("threads:", sorted({n.split("-")[0] for n, _ in profs}), file=sys.stderr)
