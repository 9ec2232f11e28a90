"""On the device: kiln serve's GPU metrics through NVML, the engine process holding memory."""
import multiprocessing as mp, os, time

def hold(ready):
    import torch
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    ready.set(); time.sleep(30)

if __name__ == "__main__":
    from prometheus_client import generate_latest
    from serving.metrics import ServerMetrics
    ctx = mp.get_context("spawn"); ready = ctx.Event()
    child = ctx.Process(target=hold, args=(ready,)); child.start(); ready.wait(60); time.sleep(1)
    metrics = ServerMetrics(); metrics.watch_engine_process(lambda: child.pid)
    print("engine pid", child.pid)
    print("\n".join(l for l in generate_latest(metrics.registry).decode().splitlines() if "kiln_gpu" in l))
    import pynvml
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    print("NVML processes:", [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])
    child.terminate()
