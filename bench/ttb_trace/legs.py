"""Bench only: per slow GET of a trace.py run, was the request or the reply leg late (or was it parked)."""
import json, glob, sys, numpy as np, bisect
d = sys.argv[1]
for cf in sorted(glob.glob(f"{d}/c.*.json")):
    c = json.load(open(cf))
    dev = []
    for df in glob.glob(f"{d}/d.[0-9]*"):
        try: e = json.load(open(df))
        except Exception: continue
        dev += e
    handles = sorted((x[1], x[2]) for x in dev if x[0] == "handle")
    routes = sorted((x[1], x[2]) for x in dev if x[0] == "route")
    parks = sorted(x[1] for x in dev if x[0] == "park")
    hs = [h[0] for h in handles]; rs = [r[0] for r in routes]; ps = parks
    rows = []
    for t0, t1, w in c["lat"]:
        i = bisect.bisect_left(hs, t0)
        if i >= len(hs) or hs[i] > t1: continue
        hst = hs[i]
        j = bisect.bisect_right(rs, t1) - 1  # last route before client got it
        rend = routes[j][1] if j >= 0 and routes[j][0] >= t0 else None
        k = bisect.bisect_left(ps, t0); parked = k < len(ps) and ps[k] <= t1
        rows.append(((t1 - t0) / 1e6, (hst - t0) / 1e6, (rend - t0) / 1e6 if rend else None, parked))
    rows.sort(key=lambda r: -r[0])
    n = len(c["lat"])
    print(f"{cf} n {n} matched {len(rows)}; > 1 ms: {sum(r[0] > 1 for r in rows)}")
    cnt = {"parked": 0, "request leg": 0, "reply leg": 0, "other": 0}
    for tot, req, rep, parked in rows:
        if tot < 1: break
        if parked: cnt["parked"] += 1
        elif req > 0.5 * tot: cnt["request leg"] += 1
        elif rep is not None and tot - rep > 0.5 * tot: cnt["reply leg"] += 1
        else: cnt["other"] += 1
    print("   ", cnt)
    for r in rows[:6]: print("    total %.3f  handle at %.3f  route end %s parked %s" % (r[0], r[1], "%.3f" % r[2] if r[2] else None, r[3]))
