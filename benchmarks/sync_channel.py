"""CPU per frame of the workers' sync channel: `router.sync.local` against ZMQ PUB/SUB.

    .venv/bin/python -m benchmarks.sync_channel [--rate 600] [--seconds 5] [--rounds 3]

Two processes, one sending frames at a paced rate (`--rate` a second, 120 bytes each,
about a request's routed prompt and in-flight counts), the other receiving them in its
event loop; CPU of both processes (all their threads), rounds interleaved:

- `pacing only`: the sender's loop paces without sending: what the others are net of;
- `zmq asyncio`: a plain PUB bound on `ipc://`, a `zmq.asyncio` SUB (what `router.sync`
  used between workers until it moved to datagrams, and between replicas, over TCP);
- `zmq reader`: the same PUB, a plain SUB read from the event loop's reader callback on
  its `ZMQ_FD` (what the peer channel between replicas does now, over TCP);
- `datagram`: `router.sync.local.LocalChannel` on both sides, its urgent lane (read by
  the receiving loop as each frame arrives: how every frame between workers went until
  the state lane);
- `datagram state lane`: the same channel's state lane, which the receiver reads every
  `catch_up_s` (20 ms) and never by a wake-up of its loop: a worker that receives no
  requests (one that does reads it before each pick, at no wake-up at all).

Paced rather than flooded: a router sends a frame when a request gives it one, and at a
few hundred a second each frame wakes the receiver (and, with ZMQ, both I/O threads)
on its own; a flood would batch them and flatter every channel.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import resource
import tempfile
from collections.abc import Callable
from multiprocessing.queues import Queue
from typing import Final, cast

import zmq
import zmq.asyncio

from router.sync import SyncConfig
from router.sync.local import LocalChannel

FRAME: Final = b"x" * 120
#: Seconds each process waits for the other to bind before the measured part.
SETTLE_S: Final = 1.0
Result = tuple[int, float, int, int]  # worker, CPU seconds, frames sent, frames received


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


async def _measure(
    worker: int, send: Callable[[bytes], None], received: list[int], rate: float,
    seconds: float,
) -> Result:
    await asyncio.sleep(SETTLE_S)
    loop = asyncio.get_running_loop()
    cpu0, began, sent = _cpu(), loop.time(), 0
    while loop.time() - began < seconds:
        if worker == 0:
            send(FRAME)
            sent += 1
            await asyncio.sleep(1 / rate)
        else:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the last frames arrive
    return worker, _cpu() - cpu0, sent, received[0]


def _pacing(worker: int, run_dir: str, rate: float, seconds: float, out: Queue[Result]) -> None:
    out.put(asyncio.run(_measure(worker, lambda frame: None, [0], rate, seconds)))


def _zmq(
    worker: int, run_dir: str, rate: float, seconds: float, out: Queue[Result], reader: bool
) -> None:
    async def main() -> Result:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"ipc://{run_dir}/zmq-{worker}.ipc")
        sub = (context if reader else zmq.asyncio.Context.shadow(context)).socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{run_dir}/zmq-{1 - worker}.ipc")
        received = [0]
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)

        def drain() -> None:  # read what is queued, as router.sync does
            while cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                raw.recv(zmq.NOBLOCK)
                received[0] += 1

        async def receive() -> None:
            while True:
                await cast(zmq.asyncio.Socket, sub).recv()
                received[0] += 1
                drain()

        loop = asyncio.get_running_loop()
        fd = cast(int, raw.getsockopt(zmq.FD))
        task = None
        if reader:
            loop.add_reader(fd, drain)
        else:
            task = asyncio.create_task(receive())
        try:
            return await _measure(worker, lambda f: pub.send(f, zmq.NOBLOCK), received, rate,
                                  seconds)
        finally:
            if task is not None:
                task.cancel()
            else:
                loop.remove_reader(fd)
            pub.close()
            sub.close()
            context.term()

    out.put(asyncio.run(main()))


def _datagram(
    worker: int, run_dir: str, rate: float, seconds: float, out: Queue[Result], urgent: bool
) -> None:
    async def main() -> Result:
        received = [0]

        def count(frame: bytes) -> None:
            received[0] += 1

        config = SyncConfig(host_id="bench", worker=worker, workers=2, run_dir=run_dir)
        channel = LocalChannel(config, count, lambda dropped: None)
        channel.open(asyncio.get_running_loop())

        async def catch_up() -> None:  # the state lane's reader: SyncNode's backstop
            while True:
                await asyncio.sleep(config.catch_up_s)
                channel.drain()

        reader = None if urgent else asyncio.create_task(catch_up())
        try:
            send = functools.partial(channel.send, urgent=urgent)
            return await _measure(worker, send, received, rate, seconds)
        finally:
            if reader is not None:
                reader.cancel()
            channel.close()

    out.put(asyncio.run(main()))


CHANNELS: Final[dict[str, Callable[..., None]]] = {
    "pacing only": _pacing,
    "zmq asyncio": functools.partial(_zmq, reader=False),
    "zmq reader": functools.partial(_zmq, reader=True),
    "datagram": functools.partial(_datagram, urgent=True),
    "datagram state lane": functools.partial(_datagram, urgent=False),
}


def run_pair(name: str, rate: float, seconds: float) -> tuple[float, float, int, int]:
    """(sender CPU, receiver CPU) seconds, frames sent and received, for one channel."""
    out: Queue[Result] = mp.Queue()
    with tempfile.TemporaryDirectory(prefix="pdgate-sync-bench-") as run_dir:
        procs = [mp.Process(target=CHANNELS[name], args=(w, run_dir, rate, seconds, out))
                 for w in (0, 1)]
        for proc in procs:
            proc.start()
        results = sorted(out.get(timeout=seconds + 30) for _ in procs)
        for proc in procs:
            proc.join()
    (_, sender, sent, _), (_, receiver, _, received) = results
    return sender, receiver, sent, received


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=600.0, help="frames a second")
    parser.add_argument("--seconds", type=float, default=5.0, help="per channel and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{args.rate:.0f} frames/s of {len(FRAME)} bytes, {args.seconds:.0f} s per channel "
          f"and round, CPU of both processes (all threads)\n")
    print("| round | channel | frames sent / received | sender µs/frame | receiver µs/frame "
          "| both, net of pacing µs/frame |")
    print("| --- | --- | --- | --- | --- | --- |")
    for round_ in range(1, args.rounds + 1):
        pacing = 0.0
        for name in CHANNELS:
            sender, receiver, sent, received = run_pair(name, args.rate, args.seconds)
            per = 1e6 / max(1, sent)
            if name == "pacing only":
                pacing = (sender + receiver) * per
            net = "" if name == "pacing only" else f"{(sender + receiver) * per - pacing:.0f}"
            print(f"| {round_} | {name} | {sent} / {received} | {sender * per:.0f} "
                  f"| {receiver * per:.0f} | {net} |", flush=True)


if __name__ == "__main__":
    main()
