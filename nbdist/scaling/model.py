"""The analytic performance model: samples/s, time per step and staleness for any ranks.

From a `Calibration` (what the probe measured) and a `Machine` (nodes, cores, network):

allreduce  a step is every rank's forward and backward (the slowest rank's: the expected
           maximum of W draws from the measured spread), the loop's own costs, and the
           part of the gradient's allreduce that backward does not hide. The allreduce is
           hierarchical: within a node with the measured shared-memory costs, between
           nodes with the network preset; ring (2 (p - 1) latency terms, 2 (p - 1) / p of
           the bytes) or tree (recursive doubling: log2 p rounds of the whole message),
           whichever is faster, per bucket of --bucket-mb. Buckets but the last overlap
           the backward pass.
master/    W workers around one master: a closed queueing network (queueing.py). A worker's
worker     cycle is `sync_every` batches of compute plus its side of the exchange (think
           time Z), the messages' way (a delay) and the master's response (queueing and
           its service S: its loop, the rule's apply, receiving the message, and looking
           at every client's posted receive once per pass). Staleness: in the long run a
           worker sees one update from each other worker per cycle, W - 1, less the ones
           applied in the same pass as its own and answered with it (the master takes up
           to two ready updates per pass).
sub-       M masters of W workers each; a sub-master pushes its displacement to the top
masters    master after every W updates and waits for the reply, which stretches its own
           service; the top master serves its own workers and the sub-masters' pushes (a
           two-class network). Solved together by fixed-point iteration.

More ranks than cores on a node (the points a 2-core machine can measure beyond 2 ranks,
or fewer where other processes take some of the cores: `Machine.cores` is what they leave)
share the cores (processor sharing), every time a core's own CPU time as calibrated:
- allreduce: the ranks take turns; a rank that is done sleeps between polls where the ranks
  outnumber the node's cores (the others get its share), and polls, keeping its share,
  where they do not (other processes share the cores);
- master/worker: the workers share what the masters' services leave (queueing.py); a
  master's service holds a core, or all the ranks have where that is less than one;
- time slices: a rank that becomes runnable waits its turn on a core (`turn_s`, measured
  with one runnable too many, for each beyond the cores); an update waits so for the master
  to notice it, which an asynchronous worker's cycle loses, and what comes meanwhile is
  served in the same pass, which lowers the staleness below W - 1; an allreduce step, or
  a synchronous round whose ranks poll, loses `slicing_s` to it, once a step; a
  synchronous master's round whose ranks sleep, two turns (the master's for the last
  body, the last worker's for its reply);
- waiting ranks sleep between polls where they outnumber the node's cores, which adds at
  least half a poll sleep to each wait.

The allreduce topology's step, and the slowest of several ranks' steps, are
allreduce_model.py's; the rest is here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nbdist.scaling.allreduce_model import BACKWARD_SHARE, allreduce_point, allreduce_seconds, expected_max, makespan
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.network import Machine
from nbdist.scaling.queueing import Closed, mva, mva_shared_cores, saturation_workers, two_class_mva
from nbdist.scaling.setups import Point, SetUp

__all__ = ["PerformanceModel", "BACKWARD_SHARE", "DEFAULT_BUCKET_BYTES", "expected_max", "makespan"]

DEFAULT_BUCKET_BYTES = 2 * 2**20  # --bucket-mb's default
PASS_UPDATES = 2  # the most ready updates one pass of an asynchronous master serves (ASYNC_BODIES)


@dataclass(frozen=True, slots=True)
class _Exchange:
    """One worker's cycle with its master: CPU seconds, seconds without the CPU, the
    master's CPU seconds per update, and how they split for the report."""

    compute: float
    delay: float
    service: float
    talk: float  # the worker's own exchange costs (a part of `compute` for the CPU)
    sweep: float  # the master's look at every client's posted receive, once per pass
    wake: float = 0.0  # the master's delay to notice an update: asleep, or waiting for its turn on a core


class PerformanceModel:
    """Predictions from a calibration on a machine; `bucket_bytes` is --bucket-mb in bytes,
    `overlap` the share of backward that a bucket's reduction can really use (1: the
    reduction progresses on its own, as NCCL's or an MPI with a progress thread does)."""

    def __init__(
        self,
        calibration: Calibration,
        machine: Machine,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: float = 1.0,
    ):
        calibration.check()
        self.cal, self.machine = calibration, machine
        self.bucket_bytes, self.overlap = bucket_bytes, overlap

    # -- compute ----------------------------------------------------------------------
    def compute_s(self, batch: int, busy: float) -> float:
        """One forward and backward with `busy` ranks of the node computing at once (at most
        its cores: beyond that they share cores, which the callers model)."""
        cal, cores = self.cal, self.machine.own_cores
        share = 0.0 if cores <= 1 else (min(max(busy, 1.0), cores) - 1.0) / (cores - 1.0)
        return cal.compute_s(batch) * (1.0 + (cal.busy_factor - 1.0) * share)

    def slicing_s(self, runnable: float) -> float:
        """What a synchronous step loses to the cores being time-sliced, not shared evenly,
        with `runnable` ranks on a node: measured with one beyond the cores, and once a
        step however many more (the step waits for its last rank's last slice; the others'
        slices run meanwhile on the other cores, and the even sharing counts them)."""
        return self.cal.round_extra_s * min(1.0, max(0.0, runnable - self.machine.cores))

    def round_runnable(self, setup: SetUp, ranks: int) -> float:
        """The ranks of a node that take turns on its cores in a synchronous round: all of
        an allreduce's; a synchronous master's workers, and its master where it polls (where
        ranks outnumber the cores it sleeps in its wait for the bodies, as its workers do)."""
        per_node = self.machine.ranks_per_node(ranks)
        if setup.allreduce or not self.machine.sleeps(ranks):
            return per_node
        masters_here = setup.masters if self.machine.nodes_for(ranks) == 1 else 0
        return max(1.0, per_node - masters_here)

    def round_slicing_s(self, setup: SetUp, ranks: int) -> float:
        """What a synchronous step or round loses to the node's cores being time-sliced: an
        allreduce's, or a round whose ranks poll, `slicing_s`; a synchronous master's round
        whose ranks sleep, two waits for a turn on a core, the master's when the last body
        comes and the last worker's when the replies go out (no rounds of messages that
        each wait for both ends' slices, as an allreduce's have). Where the calibration has
        no count of turns, `slicing_s` stands in."""
        runnable = self.round_runnable(setup, ranks)
        if setup.allreduce or not self.machine.sleeps(ranks) or not self.cal.turn_s:
            return self.slicing_s(runnable)
        return 2.0 * self.turn_s(runnable)

    def turn_s(self, runnable: float) -> float:
        """How long a rank that becomes runnable waits for its turn on a core with
        `runnable` ranks on a node: the measured wait with one runnable too many, for each
        one beyond the cores (the ranks' share of them, where other processes take some);
        where the calibration has no such count, what time-slicing costs a step."""
        per = self.cal.turn_s or self.cal.round_extra_s
        return per * max(0.0, runnable - self.machine.cores)

    def sleeping_wait_s(self, others_work: bool = False) -> float:
        """What a wait costs more when ranks sleep between polls (more ranks than cores):
        measured, a message's way with its receiver sleeping on busy cores, less its way
        with the receiver polling; at least half a poll sleep (the rest of the sleep it is
        in when its message comes). `others_work`: where other ranks compute while this one
        waits (master/worker), less the receiver's wait for its turn on a core (`turn_s`):
        the core does their work meanwhile, which the processor sharing of the cores counts
        already. In a collective every rank waits at once: nothing fills that wait."""
        wake = self.cal.wake_s - (self.cal.turn_s if others_work else 0.0)
        return max(self.cal.poll_sleep_s / 2.0, wake)

    # -- allreduce --------------------------------------------------------------------
    def allreduce_s(self, ranks: int, nbytes: int, algorithm: str = "best") -> float:
        """An allreduce of `nbytes` over `ranks` ranks, in buckets; "ring", "tree" or the
        faster (allreduce_model.py)."""
        return allreduce_seconds(self, ranks, nbytes, algorithm)

    # -- master/worker ----------------------------------------------------------------
    def message_s(self, bytes_: int, off_node: bool) -> float:
        """One message's way from a rank to another (latency and bytes)."""
        cal, net = self.cal, self.machine.net
        if off_node:
            return net.latency_s + bytes_ * net.beta_s
        return cal.p2p_alpha_s + bytes_ * cal.p2p_beta_s

    def exchange(self, setup: SetUp, batch: int, workers_per_master: int, ranks: int) -> _Exchange:
        """The mean worker's cycle with its master, over where the workers are placed."""
        cal, machine = self.cal, self.machine
        cal.check_rule(setup.rule)
        per_node = machine.ranks_per_node(ranks)
        # The workers that compute at once on a node (a master's polling does not slow them).
        masters_here = setup.masters if machine.nodes_for(ranks) == 1 else 0
        busy = min(max(1, per_node - masters_here), machine.own_cores)
        nbytes = cal.message_bytes
        k = max(1, setup.sync_every)
        talk = cal.worker_exchange_s[setup.rule]
        compute = k * (self.compute_s(batch, busy) + cal.worker_step_s[setup.rule]) + talk
        block = 1 + workers_per_master  # a master and its workers are neighbours in rank order
        off = sum(1 for w in range(1, block) if machine.node_of(w, ranks) != 0) / max(1, workers_per_master)
        # What a lone worker waits beyond the service (measured within the node), with the
        # way there and back over the network for the workers on other nodes.
        delay = cal.reply_latency_s + off * self._network_extra()
        if machine.sleeps(ranks):
            # the worker's wait for its reply, the master's for the update; a synchronous
            # round's workers all wait at once, like a collective's ranks
            delay += 2 * self.sleeping_wait_s(not setup.synchronous)
            if not setup.synchronous:
                # And the master's wait for its turn on a core, once an exchange: the
                # processor sharing gives the other ranks' work that time, but this worker,
                # blocked on its reply, loses it (bench/results/2026-11-28-scaling_model-turns.md).
                delay += self.turn_s(per_node)
        receive = (1 - off) * nbytes * cal.p2p_beta_s + off * nbytes * machine.net.beta_s
        service = cal.master_fixed_s + cal.apply_s[setup.rule] + receive
        sweep = cal.client_test_s * (workers_per_master + setup.masters - 1)
        wake = self.sleeping_wait_s(True) if machine.sleeps(ranks) else 0.0
        # On cores shared with more runnable processes than there are, an update waits for
        # the master's turn on a core (the time slices of the others): the sharing's
        # stretch of its service is in the queueing network already, but updates that come
        # meanwhile are served in the same pass, which is what staleness sees.
        wake = max(wake, self.turn_s(per_node))
        return _Exchange(compute, delay, service, talk, sweep, wake)

    def _network_extra(self) -> float:
        """What a message there and back costs more between nodes than within one."""
        nbytes = self.cal.message_bytes
        return 2.0 * max(0.0, self.message_s(nbytes, True) - self.message_s(nbytes, False))

    def _solve(self, ex: _Exchange, workers: int, ranks: int, others: float = 0.0, masters_busy: float = 0.0) -> Closed:
        """The closed network of one master and its `workers`. Each pass of the master looks
        at every client once (`sweep`) and serves up to PASS_UPDATES ready updates, so the
        sweep's share per update falls as the queue grows. On a node with more ranks than
        cores, the workers share them with `others` ranks computing elsewhere and with the
        other masters, busy `masters_busy` of the time."""
        machine = self.machine
        per_pass = 1.0
        net = None
        for _ in range(50):
            service = ex.service + ex.sweep / per_pass
            if machine.oversubscribed(ranks) and not machine.sleeps(ranks):
                # Ranks that poll (a core each on the node, other processes taking some)
                # never leave the cores: each of them, master too, gets an even share.
                stretch = machine.ranks_per_node(ranks) / machine.cores
                net = mva(workers, ex.compute * stretch + ex.delay, service * stretch)
            elif machine.oversubscribed(ranks):
                net = mva_shared_cores(
                    workers,
                    ex.compute,
                    ex.delay,
                    service,
                    machine.cores,
                    other_load=others,
                    other_masters_busy=masters_busy,
                )
            else:
                net = mva(workers, ex.compute + ex.delay, service)
            new = 1.0 + (PASS_UPDATES - 1) * min(1.0, _waiting(net, ex, workers))
            if abs(new - per_pass) < 1e-4:
                break
            per_pass = 0.5 * (per_pass + new)
        assert net is not None
        return net

    def _master_worker(self, setup: SetUp, ranks: int, batch: int) -> Point:
        if setup.synchronous:
            return self._synchronous(setup, ranks, batch)
        if setup.masters > 1:
            return self._sub_masters(setup, ranks, batch)
        w = setup.workers_per_master(ranks) or 1
        ex = self.exchange(setup, batch, w, ranks)
        net = self._solve(ex, w, ranks)
        return self._point(
            setup, ranks, batch, w, ex, net.x, _staleness(w, net, ex, 0.0), net.u, _computing(net, ex), _extra(net)
        )

    def _sub_masters(self, setup: SetUp, ranks: int, batch: int) -> Point:
        cal, m = self.cal, setup.masters
        w = setup.workers_per_master(ranks) or 1
        ex = self.exchange(setup, batch, w, ranks)
        off = self.machine.nodes_for(ranks) > 1
        push_delay = cal.reply_latency_s + (self._network_extra() if off else 0.0)
        if self.machine.sleeps(ranks):
            push_delay += 2 * self.sleeping_wait_s(True)
        nbytes = cal.message_bytes
        merge = cal.master_fixed_s + (cal.merge_s or min(cal.apply_s.values()))
        merge += nbytes * (self.machine.net.beta_s if off else cal.p2p_beta_s) + ex.sweep
        push_cpu = cal.worker_exchange_s.get("downpour", ex.talk)
        top_wait, sub, top_w, top_s = ex.service, None, None, None
        busy_elsewhere, masters_busy = 0.0, 0.0
        for _ in range(100):
            # A sub-master's push every W updates holds its loop: its service per update grows.
            stretched = replace(ex, service=ex.service + (push_cpu + push_delay + top_wait) / w)
            sub = self._solve(stretched, w, ranks, busy_elsewhere, masters_busy)
            # The other blocks are alike: what one block's ranks keep busy, the others do too.
            busy_elsewhere, masters_busy = (m - 1) * sub.n_computing, (m - 1) * sub.u
            computing = sub.n_computing / sub.x if sub.x else ex.compute
            sm_think = max(0.0, w / sub.x - top_wait - push_delay)
            top_w, top_s = two_class_mva(
                (w, m - 1),
                (computing + ex.delay, sm_think + push_delay),
                (ex.service + ex.sweep / (1.0 + min(1.0, _waiting(sub, ex, w))), merge),
            )
            if abs(top_s.r - top_wait) <= 1e-6 * top_wait:
                break
            top_wait = 0.5 * (top_wait + top_s.r)
        assert sub is not None and top_w is not None and top_s is not None
        updates = top_w.x + (m - 1) * sub.x
        # Versions at the top move with its workers' updates and every merge (top_s.x: the
        # sub-masters' pushes per second); at a sub-master with its workers' and each pull,
        # one per W updates, which the workers answered in the pull's own pass already see.
        top_cycle = w / top_w.x if top_w.x else 0.0
        top_stale = _staleness(w, top_w, ex, top_s.x * top_cycle, top_s.x)
        sub_stale = _staleness(w, sub, ex, 1.0 - 1.0 / w)
        staleness = (top_w.x * top_stale + (m - 1) * sub.x * sub_stale) / updates
        extra = {"service_s": sub.s, "response_s": top_w.r}
        return self._point(setup, ranks, batch, w, ex, updates, staleness, top_w.u, _computing(sub, ex), extra)

    def _synchronous(self, setup: SetUp, ranks: int, batch: int) -> Point:
        """A round: every worker's cycle, the slowest's, then the master takes the W bodies,
        applies once and answers all."""
        cal = self.cal
        w = setup.workers_per_master(ranks) or 1
        ex = self.exchange(setup, batch, w, ranks)
        machine = self.machine
        if machine.oversubscribed(ranks):
            per_node = machine.ranks_per_node(ranks)
            if machine.sleeps(ranks):  # as allreduce: a worker that is done sleeps
                slowest = ex.compute * makespan(cal.spread, w, machine.cores)
            else:  # or polls, keeping its share (and the master polls too)
                slowest = ex.compute * expected_max(cal.spread, w) * per_node / machine.cores
            slowest += self.round_slicing_s(setup, ranks)
        else:
            slowest = ex.compute * expected_max(cal.spread, w)
        # A round receives every body, then folds them in at once (master_round).
        apply = cal.apply_s[setup.rule]
        serving = w * (ex.service - apply) + cal.round_s.get(setup.rule, apply) + ex.sweep
        round_s = slowest + ex.delay + serving
        updates = setup.masters * w / round_s
        point = self._point(setup, ranks, batch, w, ex, updates, 0.0, serving / round_s, ex.compute, {})
        point.staleness_p99 = 0.0
        return point

    def _point(
        self,
        setup: SetUp,
        ranks: int,
        batch: int,
        w: int,
        ex: _Exchange,
        updates: float,
        staleness: float,
        util: float,
        computing: float,
        extra: dict[str, float],
    ) -> Point:
        """A master/worker point from its update rate; `computing`: a worker's CPU time per
        cycle as it stretches on shared cores."""
        cycle = setup.masters * w / updates
        return Point(
            setup,
            ranks,
            setup.masters * w,
            batch,
            samples_per_s=updates * max(1, setup.sync_every) * batch,
            step_s=cycle,
            compute_s=max(0.0, computing - ex.talk),
            communicate_s=ex.talk + ex.delay,
            wait_s=max(0.0, cycle - computing - ex.delay),
            staleness_mean=staleness,
            master_utilisation=min(1.0, util),
            cores=self.machine.cores_for(ranks),
            oversubscribed=self.machine.sleeps(ranks),
            extra=extra,
        )

    # -- the public face --------------------------------------------------------------
    def predict(self, setup: SetUp, ranks: int, batch: int | None = None, scaling: str = "weak") -> Point:
        """The figures of `setup` on `ranks` ranks, at `batch` samples per worker."""
        batch = batch or self.cal.batch_size
        if setup.workers(ranks) is None:
            raise ValueError(f"{setup.label} cannot be laid out on {ranks} ranks")
        if setup.allreduce:
            point = allreduce_point(self, setup, ranks, batch)
        else:
            point = self._master_worker(setup, ranks, batch)
        point.scaling = scaling
        return point

    def saturation(self, setup: SetUp, batch: int | None = None) -> float:
        """The workers one master serves before it saturates, W* = (Z + S) / S, with the
        workers on other nodes (the master's loop looks at each client once per pass: S
        grows with W, so W* is where W = (Z + S(W)) / S(W))."""
        batch = batch or self.cal.batch_size
        flat = SetUp(setup.topology, setup.rule, 1, setup.sync_every)
        workers = 1.0
        for _ in range(100):
            ranks = 1 + max(1, int(workers))
            ex = self.exchange(flat, batch, ranks - 1, ranks)
            service = ex.service + ex.sweep / PASS_UPDATES
            new = saturation_workers(ex.compute + ex.delay, service)
            if abs(new - workers) < 1e-7 * new:
                break
            workers = 0.5 * (workers + new)
        return workers


def _computing(net: Closed, ex: _Exchange) -> float:
    """A worker's time computing per cycle (stretched where it shares cores)."""
    return net.n_computing / net.x if net.x else ex.compute


def _extra(net: Closed) -> dict[str, float]:
    return {"service_s": net.s, "response_s": net.r}


def _waiting(net: Closed, ex: _Exchange, workers: int, other_rate: float = 0.0) -> float:
    """Updates an arriving update finds queued behind the one in service, and, where the
    master is slow to notice it (asleep, or waiting for its turn on a core), those that
    arrive meanwhile (served in the same pass): from the other workers, and at `other_rate`
    per second from other clients (a top master's sub-masters)."""
    arrivals = net.x * (workers - 1) / max(1, workers) + other_rate
    return max(0.0, net.q_seen - net.u) + arrivals * ex.wake


def _staleness(workers: int, net: Closed, ex: _Exchange, other_versions: float, other_rate: float = 0.0) -> float:
    """Mean versions between a worker's reply and its next update: W - 1 (and whatever else
    moves the master's version meanwhile), less those answered in its own pass: of two
    updates served in one pass, the first one's worker is answered after the second."""
    paired = 0.5 * min(1.0, _waiting(net, ex, workers, other_rate)) * (PASS_UPDATES - 1)
    return max(0.0, workers - 1 + other_versions - paired)
