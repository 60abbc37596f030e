"""Synthetic training throughput of a ResNet with hora.torch, in images per second.

The counterpart of Horovod's ``pytorch_synthetic_benchmark``: the same flags and the same printout,
on random images and labels generated once, so that only compute and gradient averaging are
measured. torchvision is not needed: the ResNets are defined below. The defaults suit a small CPU
box (64x64 images, batch 16, 5 warm-up batches, 10 iterations of 5 batches); Horovod's are
``--image-size 224 --batch-size 32 --num-warmup-batches 10 --num-batches-per-iter 10``.

    hora run -np 2 python examples/pytorch_synthetic_benchmark.py
    hora run -np 2 python examples/pytorch_synthetic_benchmark.py --fp16-allreduce --num-iters 5
"""

from __future__ import annotations

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hora.torch as hvd

# ---- the models ---------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection when the shape changes)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    """The ImageNet ResNet layout: 7x7 stem, max-pool, four stages of blocks, global pool, classifier."""

    def __init__(self, blocks_per_stage: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        in_planes = 64
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
            stride = 1 if index == 0 else 2
            layers = []
            for block in range(count):
                layers.append(BasicBlock(in_planes, planes, stride if block == 0 else 1))
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class DeepMLP(nn.Module):
    """100 Linear layers of widths 64-256 (200 parameter tensors, 2.9 M parameters) on a pooled 8x8
    image: many small gradients per step, where the per-tensor cost of gradient reduction shows."""

    def __init__(self, layers: int = 100, num_classes: int = 1000) -> None:
        super().__init__()
        widths = [3 * 8 * 8] + [(256, 128, 64, 192)[i % 4] for i in range(layers - 1)] + [num_classes]
        self.pool = nn.AdaptiveAvgPool2d(8)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(x), 1)
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


MODELS = {
    "resnet18": lambda: ResNet([2, 2, 2, 2]),   # 11.7 M parameters
    "resnet34": lambda: ResNet([3, 4, 6, 3]),   # 21.8 M parameters
    "mlp200": DeepMLP,                          # 200 parameter tensors, 2.9 M parameters
}


# ---- the benchmark ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="resnet18", choices=sorted(MODELS),
                        help="model to benchmark")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size, per worker")
    parser.add_argument("--image-size", type=int, default=64,
                        help="height and width of the synthetic images (Horovod uses 224)")
    parser.add_argument("--num-warmup-batches", type=int, default=5,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use adasum algorithm to do reduction")
    parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                        help="use mixed precision for training (float16 autocast with a gradient scaler; needs CUDA)")
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.use_mixed_precision and not args.cuda:
        raise SystemExit("--use-mixed-precision needs CUDA (torch.cuda.is_available() is False here); "
                         "on CPU, run without it")

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())  # ranks may share a GPU
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    cudnn = getattr(torch.backends, "cudnn", None)
    if cudnn is not None:
        cudnn.benchmark = True
    device = torch.device("cuda" if args.cuda else "cpu")

    torch.manual_seed(1234 + hvd.rank())  # different on purpose: the broadcast below makes them equal
    model = MODELS[args.model]().to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.01 * (1 if args.use_adasum else hvd.size()))
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # One fixed synthetic batch: random images and labels.
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision else None

    def benchmark_step() -> None:
        optimizer.zero_grad()
        if scaler is not None:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(data), target)
            scaler.scale(loss).backward()
            # Averaged gradients must be in place before the scaler unscales them; step() then
            # must not wait for them a second time.
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        else:
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        if args.cuda:
            torch.cuda.synchronize()

    kind = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Image size: {args.image_size}x{args.image_size}, {threads} thread(s) per worker")
    log(f"Number of {kind}s: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {kind}")
        img_secs.append(img_sec)

    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = float(1.96 * np.std(img_secs))
    log(f"Img/sec per {kind}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {kind}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    size = hvd.size()
    hvd.shutdown()
    return {"img_sec_mean": img_sec_mean, "img_sec_conf": img_sec_conf, "size": size}


if __name__ == "__main__":
    main()
