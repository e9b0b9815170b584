"""Bench only: the cores' timelines (perf sched timehist) during the slowest GETs of a trace.py run."""
import json, re, sys, bisect
c = json.load(open(sys.argv[1])); th = sys.argv[2]
names = {}
for k in c["sched"]:
    pid, tid, comm = k.split("/", 2)
    who = "D" if int(pid) == c["pid"] else ("C" if int(pid) != c["pid"] else "?")
    names[tid] = f"{who}:{comm}:{tid}"
iv = []
for line in open(th).read().splitlines()[3:]:
    p = line.split()
    try: t = float(p[0]); cpu = p[1]; task = p[2]; delay = float(p[-2]); run = float(p[-1])
    except (ValueError, IndexError): continue
    m = re.search(r"\[(\d+)(?:/(\d+))?\]$", task); tid = m.group(1) if m else "?"
    nm = names.get(tid, task)
    iv.append((t - run / 1e3, t, cpu, nm, delay))
iv.sort()
starts = [x[0] for x in iv]
lat = sorted(c["lat"], key=lambda x: -(x[1] - x[0]))
for t0, t1, w in lat[: int(sys.argv[3])]:
    a, b = t0 / 1e9, t1 / 1e9
    print(f"--- slow {1e3*(b-a):.3f} ms")
    i = bisect.bisect_left(starts, a - 0.01)
    for s, e, cpu, nm, delay in iv[i:]:
        if s > b: break
        if e < a: continue
        if nm == "<idle>": nm = "idle"
        print(f"   {cpu} {1e3*(s-a):+7.3f} .. {1e3*(e-a):+7.3f}  {nm:38s} schdelay {delay:.3f}")
