"""Bench only: the daemon's collections during the drains of a trace.py run, by generation."""
import json, glob, sys, numpy as np, collections
d = sys.argv[1]
for cf in sorted(glob.glob(f"{d}/c.*.json")):
    c = json.load(open(cf)); w = np.array([x[2] for x in c["lat"]])*1e3
    t0, t1 = c["lat"][0][0], c["lat"][-1][1]
    e = json.load(open(f"{d}/d.{c['pid']}"))
    g = [(x[3], (x[2]-x[1])/1e6, x[4]) for x in e if x[0]=="gc" and x[1] >= t0 and x[2] <= t1]
    by = collections.defaultdict(list)
    for gen, dur, th in g: by[gen].append(dur)
    print(cf.rsplit("/",1)[1], "p99 %.3f" % np.percentile(w,99), {k: (len(v), round(max(v),3), round(sum(v),2)) for k, v in sorted(by.items())}, "threads", collections.Counter(x[2] for x in g))
