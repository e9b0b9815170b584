"""Bench only: read or set a thread's EEVDF custom slice (sched_setattr, Linux >= 6.12) via ctypes."""
import ctypes, os, struct, platform
_NR = {"x86_64": (314, 315), "aarch64": (274, 275)}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
def get(tid):
    buf = ctypes.create_string_buffer(56)
    r = libc.syscall(_NR[1], tid, buf, 56, 0)
    if r != 0: raise OSError(ctypes.get_errno(), "getattr")
    return struct.unpack("IIQiIQQQII", buf.raw)
def set_slice(tid, ns):
    size, pol, flags, nice, prio, rt, dl, per, umin, umax = get(tid)
    buf = struct.pack("IIQiIQQQII", 56, pol, 0, nice, prio, ns, 0, 0, 0, 0)
    r = libc.syscall(_NR[0], tid, ctypes.c_char_p(buf), 0)
    if r != 0: raise OSError(ctypes.get_errno(), "setattr")
    return get(tid)
if __name__ == "__main__":
    print(get(0)); print(set_slice(0, 100000)); print(set_slice(0, 0))
