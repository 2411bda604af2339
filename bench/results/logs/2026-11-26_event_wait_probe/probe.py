"""Which record of an external CUDA event does a CUDA graph's captured wait wait for: the last one recorded before the
graph's launch (as a stream wait does), or the last one recorded before the wait node runs on the device?

The graph waits on the event, then marks a flag. The event is recorded on a side stream (done at once), the graph is
launched on a stream that first sleeps 0.2 s, and right after the launch the host records the event again on a stream
that sleeps 1.0 s first. Bound at launch, the graph ends after about 0.2 s; bound when the node runs, after 1.0 s.
The same with an eager wait (stream.wait_event) for comparison."""
import time
import torch

print("torch", torch.__version__, torch.cuda.get_device_name())
rate = torch.cuda.get_device_properties(0).clock_rate if hasattr(torch.cuda.get_device_properties(0), "clock_rate") else None
# cycles for about a second: calibrate _sleep
s = torch.cuda.Stream()
torch.cuda.synchronize()
t = time.perf_counter(); torch.cuda._sleep(100_000_000); torch.cuda.synchronize(); per = (time.perf_counter() - t) / 1e8
cyc = lambda sec: int(sec / per)
print(f"_sleep: {1 / per / 1e9:.2f} G cycles per second")


def trial(graphed: bool) -> float:
    ev = torch.cuda.Event(external=True)
    flag = torch.zeros(1, device="cuda")
    side, late, main = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    if graphed:
        g = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=cap):
            torch.cuda.current_stream().wait_event(ev)
            flag.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ev.record(side)                      # record 1: done at once
    with torch.cuda.stream(main):
        torch.cuda._sleep(cyc(0.2))
        if graphed:
            g.replay()
        else:
            main.wait_event(ev)
            flag.add_(1)
        done = torch.cuda.Event(); done.record(main)
    with torch.cuda.stream(late):       # record 2: the host issues it now, it completes after 1.0 s
        torch.cuda._sleep(cyc(1.0))
        ev.record(late)
    done.synchronize()
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert flag.item() == 1
    return took


for graphed in (False, True, False, True):
    print(("graph wait" if graphed else "eager wait"), f"ended after {trial(graphed):.3f} s")
