"""Bench only (bench/ttb_trace): timestamps of a daemon's IO loop, producer and collector.

Active in processes started as ``python -c ...`` when TTB_TRACE_OUT names an output prefix
(trace.py sets it and PYTHONPATH): records, on CLOCK_MONOTONIC (the client's clock too), each
Requests.handle / WireIO.route / Requests.serve_pending / poll / StepMaker._produce call and every gc run, and
rewrites ``<prefix>.<pid>`` (JSON) every 0.3 s. TTB_SLICE / TTB_PSLICE (ns: EEVDF custom slices
for the IO thread and zmq's threads / the producer thread) and TTB_YIELD were the experiments
of docs/loaderd.md, "Time to batch". It patches the daemon: never use it for figures of record.
"""
import os, sys, threading, time, json, gc
_OUT = os.environ.get("TTB_TRACE_OUT")
if _OUT and sys.argv and sys.argv[0] == "-c":
    ev = []
    now = time.monotonic_ns
    _gs = {}
    def _gccb(phase, info):
        if phase == "start":
            _gs[threading.get_ident()] = now()
        else:
            t0 = _gs.pop(threading.get_ident(), None)
            if t0 is not None:
                ev.append(("gc", t0, now(), info["generation"], threading.current_thread().name))
    gc.callbacks.append(_gccb)
    def _patch():
        try:
            from sluice.loaderd import handlers, server, wireio
            from sluice.loaderd.physical import producer
        except Exception as e:
            return
        oh = handlers.Requests.handle
        def _handle(self, frames, dropped=0):
            t0 = now(); r = oh(self, frames, dropped); ev.append(("handle", t0, now())); return r
        handlers.Requests.handle = _handle
        osp = handlers.Requests.serve_pending
        def _sp(self, r):
            t0 = now(); x = osp(self, r); ev.append(("pending", t0, now())); return x
        handlers.Requests.serve_pending = _sp
        ops = producer.StepMaker._produce
        def _ps(self, *a, **k):
            t0 = now(); x = ops(self, *a, **k); ev.append(("produce", t0, now(), threading.current_thread().name)); return x
        producer.StepMaker._produce = _ps
        import zmq
        opoll = zmq.Poller.poll
        def _poll(self, timeout=None):
            t0 = now(); x = opoll(self, timeout); ev.append(("poll", t0, now(), threading.current_thread().name)); return x
        zmq.Poller.poll = _poll
        oro = wireio.WireIO.route
        def _ro(self, *a, **k):
            t0 = now(); x = oro(self, *a, **k); ev.append(("route", t0, now())); return x
        wireio.WireIO.route = _ro
        from sluice.loaderd import parking
        opk = parking.Parking.park
        def _pk(self, item):
            ev.append(("park", now(), now())); return opk(self, item)
        parking.Parking.park = _pk
        osv = server.Server.serve
        def _sv(self, stop):
            if os.environ.get("TTB_FREEZE"):
                t = []
                for _ in range(3):
                    a = time.perf_counter(); gc.collect(); t.append(time.perf_counter() - a)
                gc.freeze()
                for _ in range(3):
                    a = time.perf_counter(); gc.collect(); t.append(time.perf_counter() - a)
                open(f"{_OUT}.gc.{os.getpid()}", "w").write(f"objects {len(gc.get_objects())} frozen {gc.get_freeze_count()} collect before/after freeze ms {[round(x*1e3,2) for x in t]}\n")
            if os.environ.get("TTB_GC0"):
                gc.set_threshold(int(os.environ["TTB_GC0"]), 10, 10)
            ns = int(os.environ.get("TTB_SLICE", "0"))
            if ns:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                import slice as SL
                SL.set_slice(0, ns)
                for tid in os.listdir("/proc/self/task"):
                    if open(f"/proc/self/task/{tid}/comm").read().startswith("ZMQbg"):
                        SL.set_slice(int(tid), ns)
                with open(f"{_OUT}.slices.{os.getpid()}", "w") as f:
                    for tid in os.listdir("/proc/self/task"):
                        f.write(f"{tid} {open(f'/proc/self/task/{tid}/comm').read().strip()} {SL.get(int(tid))}\n")
            return osv(self, stop)
        server.Server.serve = _sv
        if os.environ.get("TTB_PSLICE"):
            from sluice.loaderd.physical import steploop as SLP  # the producer thread's target: StepLoop.run
            orun = SLP.StepLoop.run
            def _run(self):
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import slice as SL
                SL.set_slice(0, int(os.environ["TTB_PSLICE"]))
                return orun(self)
            SLP.StepLoop.run = _run
        if os.environ.get("TTB_YIELD"):
            ops2 = producer.StepMaker._produce
            def _ps2(self, *a, **k):
                x = ops2(self, *a, **k); os.sched_yield(); return x
            producer.StepMaker._produce = _ps2
        from sluice.loaderd import upkeep
        ohk = upkeep.Upkeep.housekeeping
        def _hk(self, n):
            t0 = now(); x = ohk(self, n); ev.append(("hk", t0, now())); return x
        upkeep.Upkeep.housekeeping = _hk
    def _dump():
        while True:
            time.sleep(0.3)
            with open(f"{_OUT}.{os.getpid()}", "w") as f:
                json.dump(list(ev), f)
    import builtins
    oi = builtins.__import__
    done = [False]
    def _imp(name, *a, **k):
        m = oi(name, *a, **k)
        if not done[0] and name == "sluice.loaderd.cli":
            done[0] = True
            _patch()
        return m
    builtins.__import__ = _imp
    threading.Thread(target=_dump, daemon=True).start()
