"""A discrete-event simulator of the same topologies, for distributions and for checking.

Where the model gives means, the simulator plays the run out: each worker's compute is
drawn from the measured spread of step times (and made slower on straggling ranks), the
master serves a FIFO queue in passes of up to two updates as nbdist's does, answering
after the pass; sub-masters push to the top master after every W updates and wait for its
reply; allreduce rounds wait for the slowest rank. Ranks sharing the cores of an
oversubscribed node run under processor sharing (each of n runnable ranks gets cores / n
of a core). It records every update's staleness (versions, as the masters record them) and
the master's busy time, and gives throughput, mean and 99th-percentile staleness and the
master's utilisation. It uses the costs `PerformanceModel.exchange` computes, so the two
differ only in what the model leaves out: queues, distributions, passes.

An event loop on `heapq`; an allreduce or a synchronous round is vectorised over ranks
(numpy). 1,024 simulated ranks take about a second.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nbdist.scaling.model import PASS_UPDATES, PerformanceModel
from nbdist.scaling.setups import SetUp

__all__ = ["Simulator", "SimResult", "Stragglers"]


@dataclass(frozen=True, slots=True)
class Stragglers:
    """A `fraction` of the ranks compute `slowdown` times slower (a slow node, a noisy neighbour)."""

    fraction: float = 0.0
    slowdown: float = 1.0


@dataclass(slots=True)
class SimResult:
    samples_per_s: float
    updates: int
    staleness: np.ndarray  # per update, as the masters record it
    master_utilisation: float | None
    step_s: float  # a worker's mean time per step (allreduce) or per exchange
    compute_s: float
    wait_s: float
    seconds: float  # simulated time of the measured window

    @property
    def staleness_mean(self) -> float:
        return float(self.staleness.mean()) if self.staleness.size else 0.0

    @property
    def staleness_p99(self) -> float:
        return float(np.percentile(self.staleness, 99)) if self.staleness.size else 0.0


class _Cpu:
    """The cores of one node: jobs finish after their work at full speed, or, with more
    runnable jobs than cores, under processor sharing (a virtual clock that advances at
    min(1, free cores / n): every job's remaining work falls at that rate). A master's
    service is not shared (Linux runs a process that slept as soon as it wakes, and a
    master's bursts are short): while it serves it holds a core (`hold`), or all the node
    has where other processes leave less than one."""

    def __init__(self, cores: float, shared: bool):
        self.cores, self.shared = cores, shared
        self.held = 0.0
        self.virtual, self.clock = 0.0, 0.0
        self.jobs: list[tuple[float, int]] = []  # (virtual finish, job id)
        self.token = 0  # bumped whenever the next finish moves

    def _rate(self) -> float:
        return min(1.0, max(self.cores - self.held, 1e-3) / len(self.jobs)) if self.jobs else 1.0

    def _advance(self, now: float) -> None:
        if self.jobs:
            self.virtual += (now - self.clock) * self._rate()
        self.clock = now

    def hold(self, now: float, cores: float) -> None:
        self._advance(now)
        self.held += cores
        self.token += 1

    def add(self, now: float, work: float, job: int) -> None:
        self._advance(now)
        heapq.heappush(self.jobs, (self.virtual + work, job))
        self.token += 1

    def next_finish(self) -> float | None:
        if not self.jobs:
            return None
        return self.clock + max(0.0, self.jobs[0][0] - self.virtual) / self._rate()

    def pop(self, now: float) -> int:
        self._advance(now)
        _, job = heapq.heappop(self.jobs)
        self.token += 1
        return job


@dataclass
class _Master:
    index: int
    node: int
    queue: deque = field(default_factory=deque)  # clients whose update is in, in order
    busy: bool = False
    version: int = 0
    busy_time: float = 0.0
    started: float = 0.0
    serving: list = field(default_factory=list)
    unpushed: int = 0
    is_sub: bool = False
    waking: bool = False


class Simulator:
    """Simulates set-ups with the costs of `model` (its calibration and machine)."""

    def __init__(
        self,
        model: PerformanceModel,
        *,
        seed: int = 0,
        stragglers: Stragglers | None = None,
        pass_updates: int = PASS_UPDATES,
    ):
        self.model = model
        self.pass_updates = pass_updates
        self.rng = np.random.default_rng(seed)
        self.stragglers = stragglers or Stragglers()
        self.spread = np.asarray(model.cal.spread, dtype=float)

    def _slowdowns(self, count: int) -> np.ndarray:
        slow = np.ones(count)
        chosen = int(round(self.stragglers.fraction * count))
        if chosen:
            slow[self.rng.choice(count, chosen, replace=False)] = self.stragglers.slowdown
        return slow

    def run(self, setup: SetUp, ranks: int, batch: int | None = None, *, cycles: int = 40) -> SimResult:
        """About `cycles` steps (or exchanges) of every worker; the first fifth is warm-up."""
        batch = batch or self.model.cal.batch_size
        if setup.workers(ranks) is None:
            raise ValueError(f"{setup.label} cannot be laid out on {ranks} ranks")
        if setup.allreduce or setup.synchronous:
            return self._rounds(setup, ranks, batch, cycles)
        return _AsyncRun(self, setup, ranks, batch).run(cycles)

    # -- synchronous rounds: allreduce, a synchronous master ---------------------------
    def _rounds(self, setup: SetUp, ranks: int, batch: int, cycles: int) -> SimResult:
        model, machine, cal = self.model, self.model.machine, self.model.cal
        steps = max(10, cycles)
        per_node = machine.ranks_per_node(ranks)
        shared = per_node > machine.cores
        if setup.allreduce:
            workers, base = ranks, model.compute_s(batch, per_node)
            point = model.predict(setup, ranks, batch)
            fixed = point.communicate_s + cal.allreduce_loop_s * (per_node / machine.cores if shared else 1.0)
            serving = None
        else:
            workers = setup.workers(ranks) or 1
            ex = model.exchange(setup, batch, workers // setup.masters, ranks)
            base = ex.compute
            apply = cal.apply_s[setup.rule]
            serving = (workers // setup.masters) * (ex.service - apply) + cal.round_s.get(setup.rule, apply) + ex.sweep
            fixed = ex.delay + serving
        draws = self.rng.choice(self.spread, size=(steps, workers)) * base * self._slowdowns(workers)
        if shared:
            slowest = np.array([_shared_makespan(row, machine.cores, per_node) for row in draws])
            slowest = slowest + model.round_slicing_s(setup, ranks)  # time-sliced, not evenly
            mean_compute = draws.mean() * per_node / machine.cores
        else:
            slowest = draws.max(axis=1)
            mean_compute = draws.mean()
        step = slowest + fixed
        warm = steps // 5
        seconds = float(step[warm:].sum())
        per_step = workers * batch * (1 if setup.allreduce else max(1, setup.sync_every))
        return SimResult(
            samples_per_s=per_step * (steps - warm) / seconds,
            updates=(steps - warm) * (1 if setup.allreduce else workers),
            staleness=np.zeros(0 if setup.allreduce else (steps - warm) * workers),
            master_utilisation=None if serving is None else serving / float(step.mean()),
            step_s=seconds / (steps - warm),
            compute_s=float(mean_compute),
            wait_s=float((slowest - draws.mean(axis=1)).mean()),
            seconds=seconds,
        )


def _shared_makespan(works: np.ndarray, cores: float, per_node: int) -> float:
    """The last finish of jobs sharing a node's cores (processor sharing), node by node."""
    last = 0.0
    for start in range(0, len(works), per_node):
        sorted_works = np.sort(works[start : start + per_node])
        running = np.arange(len(sorted_works), 0, -1)
        steps = np.diff(np.concatenate(([0.0], sorted_works)))
        last = max(last, float((steps * np.maximum(running, cores) / cores).sum()))
    return last


class _AsyncRun:
    """One asynchronous master/worker (or sub-master) run, event by event."""

    def __init__(self, sim: Simulator, setup: SetUp, ranks: int, batch: int):
        model, machine = sim.model, sim.model.machine
        self.sim, self.setup, self.batch = sim, setup, batch
        self.m = setup.masters
        self.w = setup.workers_per_master(ranks) or 1
        self.ex = model.exchange(setup, batch, self.w, ranks)
        cal = model.cal
        nodes = machine.nodes_for(ranks)
        shared = machine.oversubscribed(ranks)
        self.cpus = [_Cpu(machine.cores, shared) for _ in range(nodes)]
        block = 1 + self.w
        self.masters = [_Master(j, machine.node_of(j * block, ranks), is_sub=j > 0) for j in range(self.m)]
        total = self.m * self.w
        self.worker_node = [machine.node_of(j * block + 1 + i, ranks) for j in range(self.m) for i in range(self.w)]
        self.slow = sim._slowdowns(total)
        self.read = [0] * total  # the version of each worker's last reply
        self.compute_work = self.ex.compute - self.ex.talk
        self.talk = self.ex.talk
        self.half_delay = self.ex.delay / 2.0
        self.pass_fixed = self.ex.sweep
        self.per_update = self.ex.service
        nbytes = cal.message_bytes
        off = nodes > 1
        self.merge = (
            cal.master_fixed_s
            + (cal.merge_s or min(cal.apply_s.values()))
            + nbytes * (machine.net.beta_s if off else cal.p2p_beta_s)
        )
        self.push_delay = cal.reply_latency_s + (model._network_extra() if off else 0.0)
        if machine.sleeps(ranks):
            self.push_delay += 2 * model.sleeping_wait_s(True)
        self.push_cpu = cal.worker_exchange_s.get("downpour", self.talk)
        if shared and not machine.sleeps(ranks):
            # Ranks that poll never leave the cores: each gets an even share all the time
            # (as the model has it), so every CPU second stretches alike.
            stretch = machine.ranks_per_node(ranks) / machine.cores
            self.compute_work, self.talk, self.push_cpu = (
                t * stretch for t in (self.compute_work, self.talk, self.push_cpu)
            )
            self.pass_fixed, self.per_update, self.merge = (
                t * stretch for t in (self.pass_fixed, self.per_update, self.merge)
            )
            for cpu in self.cpus:
                cpu.shared = False
        self.events: list = []
        self.seq = itertools.count()
        self.jobs: dict[int, tuple] = {}
        self.job_ids = itertools.count()
        self.staleness: list[int] = []
        self.applied: list[float] = []
        self.now = 0.0
        self.top_waiting: dict[int, list] = {}  # sub-master -> the pass it holds until the top replies

    # -- plumbing -------------------------------------------------------------------------
    def at(self, when: float, kind: str, *data: object) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, data))

    def cpu(self, node: int, work: float, then: tuple) -> None:
        """A job of `work` CPU seconds on `node`; `then` happens when it is done."""
        cpu = self.cpus[node]
        if not cpu.shared:
            self.at(self.now + work, *then)
            return
        job = next(self.job_ids)
        self.jobs[job] = then
        cpu.add(self.now, work, job)
        self._reschedule(node)

    def _reschedule(self, node: int) -> None:
        cpu = self.cpus[node]
        finish = cpu.next_finish()
        if finish is not None:
            self.at(finish, "cpu", node, cpu.token)

    # -- the run --------------------------------------------------------------------------
    def run(self, cycles: int) -> SimResult:
        total = self.m * self.w
        for i in range(total):
            self.compute(i)
        target = cycles * total
        handlers: dict[str, Callable[..., None]] = {
            "cpu": self.on_cpu,
            "computed": self.on_computed,
            "arrive": self.on_arrive,
            "served": self.on_served,
            "reply": self.on_reply,
            "pushed": self.on_pushed,
            "top_reply": self.on_top_reply,
            "release": self.on_release,
            "woken": self.on_woken,
        }
        while self.events and len(self.applied) < target:
            self.now, _, kind, data = heapq.heappop(self.events)
            handlers[kind](*data)
        warm = len(self.applied) // 5
        seconds = self.applied[-1] - self.applied[warm]
        updates = len(self.applied) - 1 - warm
        rate = updates / seconds if seconds > 0 else 0.0
        cycle = total / rate if rate else 0.0
        return SimResult(
            samples_per_s=rate * max(1, self.setup.sync_every) * self.batch,
            updates=updates,
            staleness=np.asarray(self.staleness[warm:], dtype=float),
            master_utilisation=min(1.0, self.masters[0].busy_time / self.now) if self.now else None,
            step_s=cycle,
            compute_s=self.compute_work,
            wait_s=max(0.0, cycle - self.ex.compute - self.ex.delay),
            seconds=seconds,
        )

    def compute(self, i: int) -> None:
        k = max(1, self.setup.sync_every)
        draws = self.sim.rng.choice(self.sim.spread, size=k).sum() / k
        work = self.compute_work * draws * self.slow[i] + self.talk
        self.cpu(self.worker_node[i], work, ("computed", i))

    def on_cpu(self, node: int, token: int) -> None:
        cpu = self.cpus[node]
        if token != cpu.token:
            return  # the finish moved since this was scheduled
        job = cpu.pop(self.now)
        then = self.jobs.pop(job)
        self.at(self.now, *then)
        self._reschedule(node)

    def on_computed(self, i: int) -> None:
        # The master notices it `wake` after it is in (asleep, or waiting for its turn on
        # a core): that part of the way is spent at the master, where what else comes
        # meanwhile joins the same pass.
        self.at(self.now + max(0.0, self.half_delay - self.ex.wake), "arrive", i // self.w, ("worker", i))

    def on_arrive(self, j: int, client: tuple) -> None:
        """An update is in; an idle master that sleeps between polls notices it `wake` later,
        with whatever else came meanwhile."""
        master = self.masters[j]
        master.queue.append(client)
        if master.busy or master.waking:
            return
        if self.ex.wake > 0:
            master.waking = True
            self.at(self.now + self.ex.wake, "woken", j)
        else:
            self.start_pass(master)

    def on_woken(self, j: int) -> None:
        master = self.masters[j]
        master.waking = False
        if not master.busy and master.queue:
            self.start_pass(master)

    def start_pass(self, master: _Master) -> None:
        take = [master.queue.popleft() for _ in range(min(self.sim.pass_updates, len(master.queue)))]
        master.busy, master.started, master.serving = True, self.now, take
        work = self.pass_fixed + sum(self.per_update if kind == "worker" else self.merge for kind, _ in take)
        self.hold(master.node, work, ("served", master.index))

    def hold(self, node: int, work: float, then: tuple) -> None:
        """A master's `work`: on a core it holds meanwhile (see _Cpu), at full speed, or
        where other processes leave the ranks less than a core, at what they leave."""
        cpu = self.cpus[node]
        held = min(1.0, cpu.cores)
        if cpu.shared:
            cpu.hold(self.now, held)
            self._reschedule(node)
            work /= held
        self.at(self.now + work, "release", node, then)

    def on_release(self, node: int, then: tuple) -> None:
        cpu = self.cpus[node]
        if cpu.shared:
            cpu.hold(self.now, -min(1.0, cpu.cores))
            self._reschedule(node)
        self.at(self.now, *then)

    def on_served(self, j: int) -> None:
        master = self.masters[j]
        for kind, who in master.serving:
            if kind == "worker":
                self.staleness.append(master.version - self.read[who])
                self.applied.append(self.now)
                master.unpushed += 1
            master.version += 1
        master.busy_time += self.now - master.started
        if master.is_sub and master.unpushed >= self.w:
            # Push before the replies: its workers continue from the merged centre.
            master.unpushed = 0
            self.top_waiting[j] = master.serving
            self.hold(master.node, self.push_cpu, ("pushed", j))
            return
        self.finish_pass(master)

    def finish_pass(self, master: _Master) -> None:
        for kind, who in master.serving:
            if kind == "worker":
                self.read[who] = master.version
                self.at(self.now + self.half_delay, "reply", who)
            else:
                self.at(self.now + self.push_delay / 2.0, "top_reply", who)
        master.serving, master.busy = [], False
        if master.queue:
            self.start_pass(master)

    def on_pushed(self, j: int) -> None:
        self.at(self.now + max(0.0, self.push_delay / 2.0 - self.ex.wake), "arrive", 0, ("sub", j))

    def on_top_reply(self, j: int) -> None:
        master = self.masters[j]
        master.version += 1  # the pull: the centre moved under its workers
        master.serving = self.top_waiting.pop(j)
        self.finish_pass(master)

    def on_reply(self, i: int) -> None:
        self.compute(i)
