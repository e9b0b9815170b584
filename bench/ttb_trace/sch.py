"""Bench only: p50/p99 of a trace.py run and each thread's run time and run-queue wait (schedstat)."""
import json, glob, sys, numpy as np
for f in sorted(glob.glob(sys.argv[1] + "/c.*.json")):
    c = json.load(open(f)); w = np.array([x[2] for x in c["lat"]])*1e3
    print(f, "load %.2f p50 %.3f p99 %.3f max %.3f" % (c["load"], np.percentile(w,50), np.percentile(w,99), w.max()), "wall", (c["lat"][-1][1]-c["lat"][0][0])/1e6)
    for k, (r, wt, n) in sorted(c["sched"].items()):
        if n: print(f"   {k:40s} run {r/1e6:8.2f} ms  wait {wt/1e6:7.2f} ms  slices {n:6d}  wait/slice {wt/max(n,1)/1e3:.1f} us")
