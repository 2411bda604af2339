import torch, time
torch.set_num_threads(1)
print(torch.backends.cpu.get_cpu_capability())
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(256,128,dtype=dt); w = torch.randn(50304,128,dtype=dt)
    torch.nn.functional.linear(x,w)
    t=time.perf_counter()
    for _ in range(3): torch.nn.functional.linear(x,w)
    print(dt, (time.perf_counter()-t)/3*1000, "ms")
