"""The Lightning callback: compresses each training step's saved activations and recalibrates adaptive bits."""

from __future__ import annotations

import functools
import gc
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_act.capture import ActivationCapture, CompressionReport, splitmix64
from lightning_act.capture.engine import check_compiled_codecs, runs_compiled, tensors_in
from lightning_act.config import CompressionConfig
from lightning_act.monitor import (
    MIB,
    StepPeakMemory,
    log_allocation,
    log_module_memory,
    module_mean_bits,
    step_holdings,
    storage_bytes,
)
from lightning_act.ops import ensure_kernels
from lightning_act.policy import AdaptiveBits, AllocatedBits, FixedBits
from lightning_act.policy.bits import bits_name
from lightning_act.policy.estimators import GradientSensitivity
from lightning_act.policy.memory_target import (
    MemoryTargetError,
    TargetBits,
    Verdict,
    parse_memory_target,
    unreachable_message,
)

LOG_PREFIX = "act"
ESTIMATORS = ("gradient", "probe", "probe_per_tensor")
# The probes' method in probe_sensitivities, per estimator.
_PROBE_METHODS = {"probe": "linearized", "probe_per_tensor": "per_tensor"}
#: How much higher than the steps around it a recalibration step may peak.
PROBE_SLACK = 1.05
#: Rows of the end-of-fit summary; past them, the full table goes to the log directory.
SUMMARY_ROWS = 20


class ActCompression(Callback):
    """Store the tensors autograd saves for backward at a few bits per value.

    Only training steps are compressed (automatic or manual optimization, gradient accumulation);
    validation and test are not. Each step logs ``saved_mib``, ``stored_mib``, ``compression_ratio``
    and ``peak_mib`` under ``act/``, and per module every ``log_every_n_steps`` (``docs/reference.md``).

    Args:
        bits: bits per stored value for every tensor (fixed policy): 1, 2, 4 or 8.
        budget: average bits per value (1 to 8, fractional allowed) for the adaptive policy, which
            gives each saved tensor 1, 2, 4, 8 bits or exact to minimise the estimated gradient
            variance, after ``warmup_steps`` and every ``recalibrate_every_n_steps`` (checkpointed).
            Statistics count, so ``budget=2`` stores what ``bits=2`` does. Not with a non-default ``bits``.
        memory_target: the peak each training step may reach, parameters, gradients, optimizer state
            and backward's buffers included: bytes (an int), a size (``"20GiB"``) or a fraction in
            (0, 1] of the device's memory. Bits are chosen as for ``budget`` within what keeps the
            measured peak of live tensors at or below it (so ``BatchSizeFinder`` finds the largest
            batch that fits); raises :class:`MemoryTargetError` if the lowest bits cannot. Not with
            ``budget`` or a non-default ``bits``.
        rules: overrides, first match wins: a key is a pattern on the module name relative to the
            LightningModule (``"net.layer4.*"``) or ``"op:"`` and a pattern on the torch function
            that saved the tensor (``"op:scaled_dot_product_attention"``); a value pins the bits
            (1, 2, 4, 8, ``"exact"``), the codec (``"quant"``, ``"division"``, ``"pool"``) or both
            (``"division:4"``). See :class:`~lightning_act.policy.SaveRules`.
        group_size: consecutive values sharing one (low, step) pair, a power of two in [8, 65536].
        min_numel: saved tensors with fewer elements are kept as they are.
        seed: seeds the rounding noise, which has its own stream: the user's random numbers
            (dropout masks, data order) never change.
        codec: how float activations are stored: ``"quant"`` (per-group quantization),
            ``"division"`` (16-bit ``block`` x ``block`` averages plus the residual at ``bits``)
            or ``"pool"`` (an average-pooled copy; lossy and biased). Masks, indices, LeakyReLU's
            and dropout's 1-bit tensors are stored losslessly, ReLU outputs by the quantizer.
        block: DIVISION's tile, or the pool codec's kernel.
        group_order: ``"auto"`` runs each tensor's quantization groups along the axis where its
            first step measures the least rounding noise; ``"memory"`` along the last.
        unfused_recurrent: run ``nn.LSTM``/``nn.GRU``/``nn.RNN`` through aten's per-step ops instead
            of the fused kernel, whose opaque workspace cannot be compressed: less memory, more time
            (``docs/reference.md``, "Recurrent layers").
        estimator: how the adaptive policy measures sensitivity: ``"gradient"`` from the normal
            training steps (no extra passes); ``"probe"`` by each tensor's linearized gradient
            error on ``probe_samples`` samples (a few passes, whatever the depth);
            ``"probe_per_tensor"`` as GACT does, one backward per saved tensor.
        recalibrate_every_n_steps: optimizer steps between recalibrations.
        warmup_steps: optimizer steps at the default bits before the first calibration.
        calibration_steps: training steps whose statistics feed one ``"gradient"`` estimate.
        probe_samples: most batch rows the ``"probe"`` estimator uses; fewer where the probes would
            peak above the last step (none: ``"gradient"`` measures that recalibration).

    Raises:
        ValueError: a setting is out of range; the message names it and what is allowed.

    Example::

        trainer = Trainer(callbacks=[ActCompression(bits=2)])
        trainer = Trainer(callbacks=[ActCompression(budget=3, rules={"fc": "exact"})])
    """

    def __init__(
        self,
        bits: int = 2,
        budget: float | None = None,
        memory_target: int | float | str | None = None,
        rules: dict[str, int | str] | None = None,
        group_size: int = 256,
        min_numel: int = 2048,
        seed: int = 0,
        codec: Literal["quant", "division", "pool"] = "quant",
        block: int = 8,
        group_order: Literal["auto", "memory"] = "auto",
        unfused_recurrent: bool = False,
        estimator: Literal["gradient", "probe", "probe_per_tensor"] = "probe",
        recalibrate_every_n_steps: int = 1000,
        warmup_steps: int = 20,
        calibration_steps: int = 4,
        probe_samples: int = 8,
    ):
        super().__init__()
        self.config = CompressionConfig(
            bits=bits,
            group_size=group_size,
            min_numel=min_numel,
            seed=seed,
            codec=codec,
            block=block,
            group_order=group_order,
            unfused_recurrent=unfused_recurrent,
        )
        if budget is not None and bits != 2:
            raise ValueError(
                f"bits={bits!r} and budget={budget!r}: set bits for a fixed policy or budget for an adaptive one"
            )
        if memory_target is not None and (budget is not None or bits != 2):
            raise ValueError(
                f"memory_target={memory_target!r} with bits={bits!r}, budget={budget!r}: a memory target chooses the "
                "bits itself; set one of bits, budget or memory_target"
            )
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator={estimator!r} is not supported; allowed: {', '.join(ESTIMATORS)}")
        if rules is not None and (not isinstance(rules, Mapping) or not all(isinstance(key, str) for key in rules)):
            raise ValueError(
                f"rules={rules!r} must be a dict from module-name patterns (or 'op:' and a torch function name) "
                "to bits or a codec, e.g. {'fc': 8, 'op:softmax': 'exact'}"
            )
        for knob, value, least in (
            ("recalibrate_every_n_steps", recalibrate_every_n_steps, 1),
            ("warmup_steps", warmup_steps, 0),
            ("calibration_steps", calibration_steps, 1),
            ("probe_samples", probe_samples, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{knob}={value!r} must be an int >= {least}")
        if memory_target is not None:
            parse_memory_target(memory_target)  # checked now; a fraction is resolved at setup
            self.policy = TargetBits(memory_target, rules=rules)
        else:
            self.policy = FixedBits(bits, rules) if budget is None else AdaptiveBits(budget, rules=rules)
        self.memory_target = memory_target
        self.estimator = estimator
        self.recalibrate_every_n_steps = recalibrate_every_n_steps
        self.warmup_steps = warmup_steps
        self.calibration_steps = calibration_steps
        self.probe_samples = probe_samples
        self.capture: ActivationCapture | None = None
        self.last_report = CompressionReport()
        self.sensitivity: dict[str, dict[int, float]] = {}
        self.recalibration_ms = 0.0
        # A memory target measures sensitivity as soon as a step after the first can size the probes.
        self._next_calibration = 2 if memory_target is not None else warmup_steps
        self._calibration_end: int | None = None
        self._gradient_estimate: GradientSensitivity | None = None
        self._history: list[dict[str, float]] = []
        self._history_steps: list[int] = []
        self._fit_started = 0.0
        self._warned_nonfinite = False
        self._step_peak: StepPeakMemory | None = None
        #: The last training step's peak memory in bytes (None where it cannot be measured).
        self.last_peak_bytes: int | None = None
        #: The largest step peak of this fit, in bytes.
        self.max_peak_bytes: int | None = None
        #: The last training step's peak before its backward began, in bytes.
        self.last_forward_peak_bytes: int | None = None
        # The least peak every later step of the same work reaches (StepPeakMemory.lasting_peak_bytes).
        self._lasting_peak_bytes: int | None = None
        self._probe_cost = ProbeCost()
        self._measured_steps = 0  # in this fit
        # Logged after the first step under the new bits, whose shapes and stored bytes it reports.
        self._pending_allocation: tuple[int, dict[str, dict[int, float]], dict[str, float]] | None = None
        self._restored_group_axes: dict[str, int | None] = {}
        self._told_all_exact = False

    @property
    def adaptive(self) -> bool:
        return isinstance(self.policy, AllocatedBits)

    @property
    def targeted(self) -> bool:
        return isinstance(self.policy, TargetBits)

    @property
    def recalibration_steps(self) -> list[int]:
        """The steps at which a recalibration chose new bits, in this process."""
        return list(self._history_steps)

    @property
    def recalibrations(self) -> int:
        """Recalibrations run in this process so far (their total time: ``recalibration_ms``)."""
        return len(self._history_steps)

    # ----------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if _is_compiled(pl_module):
            check_compiled_codecs(self.config, self.policy.rules)
        self.capture = ActivationCapture(self.config, pl_module, self.policy)
        self.capture.group_orders.restore(self._restored_group_axes)
        self._step_peak = StepPeakMemory(trainer.strategy.root_device, pl_module)
        self._probe_cost.parameter_bytes = storage_bytes(p for p in pl_module.parameters() if p.requires_grad)
        if any(isinstance(callback, BatchSizeFinder) for callback in trainer.callbacks):
            self._follow_batch_size_search(pl_module)
        ensure_kernels(trainer.strategy.root_device)
        if self.targeted:
            self.policy.target_bytes = parse_memory_target(self.memory_target, trainer.strategy.root_device)
            if _is_compiled(pl_module):
                self.policy.follow_compiled()
            if not self._step_peak.exact:
                rank_zero_warn(
                    f"lightning_act: memory_target={self.memory_target!r} is met against the "
                    f"{self._step_peak.source or 'no'} figure on this device, not live tensors: the CPU kernels are "
                    "not loaded (see lightning_act.ops.loaded_kernels())"
                )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning runs tuner callbacks first: a batch-size search is over by now.
        self._stop_following_batch_size_search(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Otherwise the first backward fails with torch's "element 0 of tensors does not require grad".
        if not any(parameter.requires_grad for parameter in pl_module.parameters()):
            raise ValueError(
                f"lightning_act: no parameter of {type(pl_module).__name__} requires grad, so fit has nothing to "
                "train and no activations are saved for backward; unfreeze the parameters to train "
                "(requires_grad_(True)) or use trainer.validate/test for a frozen model"
            )
        self._fit_started = time.perf_counter()
        self._measured_steps = 0
        if self.targeted:
            self.policy.restart()  # measured afresh in each fit
            # Earlier fits' objects in this process sit in reference cycles until collected: free them.
            gc.collect()
        if self.adaptive and self.estimator in _PROBE_METHODS and not pl_module.automatic_optimization:
            rank_zero_warn(
                f"lightning_act: estimator={self.estimator!r} needs automatic optimization (it calls training_step "
                "on a slice of the batch); using estimator='gradient' instead."
            )
            self.estimator = "gradient"

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self.capture is None:
            return
        # The step's peak includes a recalibration's probes.
        if self.targeted or self.adaptive:  # their plans and probes are sized by the lasting peak
            self._step_peak.follow_optimizers(trainer.optimizers, update_hooks=False)
        self._step_peak.start()
        if self.targeted:
            self._follow_batch_size(trainer, batch)
        if self.adaptive and self._calibration_end is None and trainer.global_step >= self._next_calibration:
            self._recalibrate(trainer, pl_module, batch, batch_idx)
        self.capture.estimator = self._gradient_estimate
        # Per step, rank and micro-batch: a resumed run replays its noise; ranks' noise is uncorrelated.
        stream = splitmix64((trainer.global_step << 24) ^ (batch_idx << 8) ^ trainer.global_rank)
        self.capture.start(inputs=batch, seed=splitmix64(self.config.seed ^ stream))
        if getattr(pl_module, "_compiler_ctx", None) is not None:  # trainer.fit(torch.compile(module))
            self.capture.watch_ops(False)  # the training step is compiled: no module call around it

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        if self.capture is not None:
            self.capture.pause()
            self.last_forward_peak_bytes = self._step_peak.peak_bytes()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.capture is not None:
            self.capture.resume()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.capture is not None and self.capture.active:
            self._step_peak.before_update()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx):
        if self.capture is None or not self.capture.active:
            return
        report = self.capture.stop()
        self.last_report = report
        figures = {
            f"{LOG_PREFIX}/saved_mib": report.saved_bytes / MIB,
            f"{LOG_PREFIX}/stored_mib": report.stored_bytes / MIB,
            f"{LOG_PREFIX}/compression_ratio": report.ratio,
        }
        self.last_peak_bytes = self._step_peak.peak_bytes()
        self._measured_steps += self.last_peak_bytes is not None
        # Automatic optimization clears gradients after the forward: they live through the next forward.
        forward_peak = self.last_forward_peak_bytes if pl_module.automatic_optimization else None
        self._lasting_peak_bytes = self._step_peak.lasting_peak_bytes(forward_peak)
        if self.last_peak_bytes is not None:
            self.max_peak_bytes = max(self.max_peak_bytes or 0, self.last_peak_bytes)
            figures[f"{LOG_PREFIX}/peak_mib"] = self.last_peak_bytes / MIB
        resident = self._step_peak.resident_peak_bytes()
        if resident is not None and self._step_peak.exact:
            figures[f"{LOG_PREFIX}/resident_peak_mib"] = resident / MIB
        if self.targeted:
            figures.update(self._follow_target(trainer, pl_module, batch, report))
        pl_module.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)
        if self._pending_allocation is not None:
            self._log_allocation(trainer, report)
        if self._calibration_end is not None and trainer.global_step >= self._calibration_end:
            started = time.perf_counter()
            sensitivity = self._gradient_estimate.sensitivities()
            self._gradient_estimate = None
            self.capture.estimator = None
            self._solve(trainer, sensitivity, started)
        if (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0:
            self._report_nonfinite(pl_module)
            if trainer.is_global_zero:
                log_module_memory(trainer.loggers, LOG_PREFIX, trainer.global_step, report, self.capture.slots)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.capture is not None:
            self.capture.close()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_allocation is not None:
            # No step ran under the last allocation: its table has bits but no bytes.
            self._log_allocation(trainer, CompressionReport())

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # trainer.log_dir broadcasts from rank zero: every rank asks.
        log_dir = trainer.log_dir if trainer.logger is not None else None
        if not self.last_report.saved_bytes or not trainer.is_global_zero:
            return
        report = self.last_report
        lines = [
            "lightning_act: activation memory of the last training step",
            report.summary(SUMMARY_ROWS),
            f"kept for backward: {report.stored_bytes / MIB:.2f} MiB stored instead of {report.saved_bytes / MIB:.2f} "
            f"MiB ({report.ratio:.2f}x)",
        ]
        if self.last_peak_bytes is None:
            lines.append("step peak: not measured on this device")
        else:
            lines.append(
                f"step peak ({self._step_peak.source}): {self.last_peak_bytes / MIB:.2f} MiB in the last step, "
                f"{self.max_peak_bytes / MIB:.2f} MiB at most; compressing saved activations lowers the peak less "
                "than the kept memory, since parameters, gradients, optimizer state and backward's buffers stay"
            )
            # Only live-tensor counts locate the peak: a resident figure hides reused freed memory.
            forward_peak = self.last_forward_peak_bytes if self._step_peak.exact else None
            if forward_peak is not None and forward_peak >= 0.99 * self.last_peak_bytes:
                lines.append(
                    "the peak is reached in the forward pass (a large transient there, such as a graph layer's "
                    "gathered messages), before backward reads anything saved: compression cannot lower it"
                )
        if self.targeted:
            lines.extend(self._target_summary())
        if len(report.modules) > SUMMARY_ROWS and log_dir is not None:
            table = Path(log_dir) / "activation_memory.txt"
            table.parent.mkdir(parents=True, exist_ok=True)
            table.write_text(report.summary(max_modules=None) + "\n")
            lines.append(f"every module: {table}")
        if log_dir is not None:
            lines.append(f"logs: {log_dir}")
        checkpoints = getattr(trainer.checkpoint_callback, "dirpath", None)
        if checkpoints is not None:
            lines.append(f"checkpoints: {checkpoints}")
        rank_zero_info("\n".join(lines))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_following_batch_size_search(pl_module)  # Tuner's search ends the fit before on_fit_start
        if self.capture is not None and stage == "fit":
            self.capture.close()
            self._step_peak.close()

    # ----------------------------------------------------------------- recalibration
    def _recalibrate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Measure sensitivity by probes where they fit in the room the last step left, else by
        the gradient estimator over the next steps (no memory of its own)."""
        if self.estimator in _PROBE_METHODS:
            if self._step_peak.live_bytes() is not None and self._measured_steps < 2:
                # The probes are sized by a measured step other than the first (one-off allocations).
                return
            if pl_module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches == 0:
                # This step's zero_grad would clear them after its forward: free them for the probes.
                for optimizer in trainer.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            rows = self._probe_rows(batch)
            if rows:
                self._recalibrate_by_probes(trainer, pl_module, batch, batch_idx, rows)
                return
            too_large = (
                f"probes on even one sample would need more than the {self._probe_room() / MIB:.1f} MiB "
                "the last step left"
            )
            if _is_compiled(pl_module):  # the gradient estimator sees no statistics inside graphs
                self._next_calibration = trainer.global_step + self.recalibrate_every_n_steps
                rank_zero_info(
                    f"lightning_act: the bits stay as they are at step {trainer.global_step}: {too_large}, "
                    f"and the model runs compiled; next try at step {self._next_calibration}"
                )
                return
            rank_zero_info(
                f"lightning_act: recalibrating the bits at step {trainer.global_step} from the gradients of "
                f"the next {self.calibration_steps} steps: {too_large}"
            )
        self._gradient_estimate = GradientSensitivity()
        self._calibration_end = trainer.global_step + self.calibration_steps

    def _probe_room(self) -> int:
        """Bytes the probes may hold above the live tensors now, so that the step peaks no higher
        than ``PROBE_SLACK`` times the last lasting peak (nor above a memory target)."""
        ceiling = int(PROBE_SLACK * self._lasting_peak_bytes)
        if self.targeted:
            ceiling = min(ceiling, self.policy.target_bytes)
        return ceiling - self._step_peak.live_bytes()

    def _probe_rows(self, batch: Any) -> int:
        """The most batch rows, up to ``probe_samples``, whose probes fit the room (0: none; a
        batch taken whole counts as one row)."""
        rows = _batch_rows(batch)
        wanted = 1 if rows is None else min(self.probe_samples, rows)
        if self._step_peak.live_bytes() is None:  # nothing to size them by
            return wanted
        row_bytes = self.last_report.saved_bytes / (rows or 1)
        room = self._probe_room()
        return next((r for r in range(wanted, 0, -1) if self._probe_cost.predict(r, row_bytes) <= room), 0)

    def _recalibrate_by_probes(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, rows: int
    ) -> None:
        started = time.perf_counter()
        sample = _leading_rows(batch, rows)
        whole = _batch_rows(batch) is None
        rank_zero_info(
            f"lightning_act: recalibrating the bits at step {trainer.global_step}: probing the saved tensors "
            f"({_PROBE_METHODS[self.estimator]}) on "
            + ("the whole batch" if whole else f"{rows} sample{'s' * (rows > 1)} of the batch")
            + ("" if whole or rows == self.probe_samples else " (as many as fit the memory the last step left)")
        )

        def loss_fn() -> torch.Tensor:
            with trainer.precision_plugin.train_step_context(), _muted_logging(pl_module):
                out = pl_module.training_step(sample, batch_idx)
            return out["loss"] if isinstance(out, Mapping) else out

        # A compiled backward frees its saved buffers as it runs, so cannot run per probe: run eagerly.
        with torch.compiler.set_stance("force_eager"):
            sensitivity, held = self._step_peak.peak_of(
                lambda: self.capture.measure_sensitivity(
                    loss_fn, inputs=sample, optimizers=trainer.optimizers, method=_PROBE_METHODS[self.estimator]
                )
            )
        if held is not None and self.last_report.saved_bytes:
            self._probe_cost.observe(rows, self.last_report.saved_bytes / (_batch_rows(batch) or 1), held)
        self._solve(trainer, sensitivity, started)

    def _solve(self, trainer: pl.Trainer, sensitivity: dict[str, dict[int, float]], started: float) -> None:
        slots = self.capture.slots
        assignment = self.policy.update(sensitivity, slots) if trainer.is_global_zero else None
        # Every rank must store the same tensors at the same bits: rank zero decides.
        assignment = trainer.strategy.broadcast(assignment, src=0)
        self.policy.assignment = dict(assignment)
        self.sensitivity = sensitivity
        self._calibration_end = None
        self._next_calibration = trainer.global_step + self.recalibrate_every_n_steps
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.recalibration_ms += elapsed_ms
        self._history.append(module_mean_bits(self.policy.assignment, slots))
        self._history_steps.append(trainer.global_step)
        training_ms = max((time.perf_counter() - self._fit_started) * 1e3, 1e-9)
        cost = {"recalibration_ms": elapsed_ms, "recalibration_pct": 100.0 * self.recalibration_ms / training_ms}
        self._pending_allocation = (trainer.global_step, sensitivity, cost)
        rank_zero_info(
            f"lightning_act: recalibrated at step {trainer.global_step} in {elapsed_ms / 1e3:.1f} s "
            f"({cost['recalibration_pct']:.1f}% of the training time so far, recalibrations included); tensors per "
            f"width: {_per_width(self.policy.assignment)}; next at step {self._next_calibration}"
        )

    def _log_allocation(self, trainer: pl.Trainer, report: CompressionReport) -> None:
        step, sensitivity, cost = self._pending_allocation
        self._pending_allocation = None
        if trainer.is_global_zero:
            log_allocation(
                trainer.loggers,
                LOG_PREFIX,
                step,
                self.policy.assignment,
                self.capture.slots,
                sensitivity,
                report,
                self._history,
                self._history_steps,
                cost,
            )

    def _report_nonfinite(self, pl_module: pl.LightningModule) -> None:
        # Reading the device counter synchronizes, so it happens at logging steps only.
        total = int(self.capture.total_nonfinite_groups)
        pl_module.log(f"{LOG_PREFIX}/nonfinite_groups", float(total), on_step=True, on_epoch=False, batch_size=1)
        if total and not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank_zero_warn(
                f"lightning_act: {total} groups of saved activations held NaN or Inf so far; they are stored "
                "as NaN (never as finite values), so the affected gradients are NaN as they would be without "
                "compression. Check the model for overflow (e.g. fp16 without loss scaling)."
            )

    # ----------------------------------------------------------------- batch-size search
    _STEP_HOOKS = (
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    )

    def _follow_batch_size_search(self, pl_module: pl.LightningModule) -> None:
        """Compress the trial steps of Lightning's batch-size search, which switches callbacks off
        but still calls the LightningModule's hooks: ours run from those until the search ends, so
        the batch found is the one that fits compressed (or fits the memory target)."""
        for name in self._STEP_HOOKS:
            setattr(
                pl_module,
                name,
                functools.partial(_this_hook_then, getattr(self, name), pl_module, getattr(pl_module, name)),
            )

    def _stop_following_batch_size_search(self, pl_module: pl.LightningModule) -> None:
        for name in self._STEP_HOOKS:
            if isinstance(pl_module.__dict__.get(name), functools.partial):
                delattr(pl_module, name)

    # ----------------------------------------------------------------- memory target
    def _follow_batch_size(self, trainer: pl.Trainer, batch: Any) -> None:
        size = storage_bytes(tensors_in(batch))
        if self.policy.follow_batch(size):
            rank_zero_info(
                f"lightning_act: the batch is {size / MIB:.2f} MiB at step {trainer.global_step}: the memory target's "
                "plan starts again from the lowest bits"
            )

    def _follow_target(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, report: CompressionReport
    ) -> dict[str, float]:
        """Compare the step's peak with the target and move the plan where it should."""
        peak, lasting = self.last_peak_bytes, self._lasting_peak_bytes
        if peak is None:
            return {}
        if trainer.world_size > 1:  # every rank must fit: the highest peak decides
            peaks = torch.tensor([float(peak), float(lasting)], device=pl_module.device)
            peak, lasting = map(int, trainer.strategy.reduce(peaks, reduce_op="max").tolist())
        figures = {f"{LOG_PREFIX}/memory_target_mib": self.policy.target_bytes / MIB}
        if self.policy.predicted_peak is not None:
            figures[f"{LOG_PREFIX}/predicted_peak_mib"] = self.policy.predicted_peak / MIB
        # A compiling step allocates extra (constants, autotuning): its peak may not be the plan's.
        verdict = self.policy.observe(lasting, self.capture.slots, compiled=self.capture.compiled_in_session)
        if verdict is Verdict.UNREACHABLE:
            self.policy.restart()  # a batch-size search goes on with a smaller batch
            raise MemoryTargetError(self._unreachable(trainer, pl_module, batch, report, peak, lasting))
        if verdict is Verdict.MOVE:
            planned = dict(self.policy.assignment)
            assignment = self.policy.update(self.sensitivity, self.capture.slots) if trainer.is_global_zero else None
            self.policy.assignment = dict(trainer.strategy.broadcast(assignment, src=0))
            if self.policy.differing(self.policy.assignment) != self.policy.differing(planned):
                rank_zero_info(
                    f"lightning_act: step {trainer.global_step} peaked at {peak / MIB:.1f} MiB against memory_target "
                    f"{self.policy.target_bytes / MIB:.1f} MiB; the plan moves to {_per_width(self.policy.assignment)} "
                    f"(predicted peak {(self.policy.predicted_peak or peak) / MIB:.1f} MiB)"
                )
        if self.policy.all_exact_fits and not self._told_all_exact:
            self._told_all_exact = True
            rank_zero_info(
                f"lightning_act: memory_target {self.policy.target_bytes / MIB:.1f} MiB is above this step's peak with "
                f"every saved tensor kept exact ({peak / MIB:.1f} MiB): nothing is compressed"
            )
        return figures

    def _unreachable(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        report: CompressionReport,
        peak: int,
        lasting_peak: int,
    ) -> str:
        held = step_holdings(pl_module, trainer.optimizers, tensors_in(batch), report.stored_bytes)
        return unreachable_message(
            self.memory_target,
            self.policy.target_bytes,
            peak,
            lasting_peak,
            trainer.global_step,
            self._step_peak.source,
            held,
            pl_module.device.type,
        )

    def _target_summary(self) -> list[str]:
        policy = self.policy
        if policy.all_exact_fits:
            return [
                f"memory target {policy.target_bytes / MIB:.2f} MiB: above the peak with every saved tensor exact; "
                "nothing compressed"
            ]
        chosen = _per_width(policy.assignment) or "every tensor at its lowest bits"
        measured = "not measured" if policy.measured_peak is None else f"{policy.measured_peak / MIB:.2f} MiB"
        return [
            f"memory target {policy.target_bytes / MIB:.2f} MiB: last step's peak {measured}; the plan: {chosen}, "
            "each tensor's bits chosen by its measured sensitivity within what the target leaves"
        ]

    # ----------------------------------------------------------------- checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"next_calibration": self._next_calibration}
        if self.adaptive:
            state["policy"] = self.policy.state_dict()
        if self.capture is not None:
            # A resumed run stores each tensor along the same axis as the run it continues.
            state["group_axes"] = dict(self.capture.group_orders.axis)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next_calibration = int(state_dict.get("next_calibration", self._next_calibration))
        if self.adaptive and "policy" in state_dict:
            self.policy.load_state_dict(state_dict["policy"])
        self._restored_group_axes = dict(state_dict.get("group_axes", {}))
        if self.capture is not None:
            self.capture.group_orders.restore(self._restored_group_axes)


def _per_width(assignment: Mapping[str, int | None]) -> str:
    """``"3 at 2, 5 at 8, 1 at exact"``: how many tensors an assignment gives each width."""
    widths = Counter(bits_name(bits) for bits in assignment.values())
    return ", ".join(f"{n} at {w}" for w, n in sorted(widths.items()))


def _this_hook_then(callback_hook, pl_module: pl.LightningModule, module_hook, *args) -> Any:
    callback_hook(pl_module.trainer, pl_module, *args)
    return module_hook(*args)


class ProbeCost:
    """Predicts what a recalibration's probes hold above the live tensors, for a number of batch
    rows: a part per row (the rows' exact saves, gradients and routed errors) and a fixed part (the
    exact parameter gradient, a perturbed parameter copy, temporaries). Each probe's measured peak
    rescales the prediction for the next."""

    #: Bytes per row, per saved byte of one row of the step.
    PER_ROW = 2.0
    #: Fixed bytes, per byte of the trainable parameters.
    FIXED = 1.8

    def __init__(self):
        self.scale = 1.0
        self.parameter_bytes = 0

    def predict(self, rows: int, row_bytes: float) -> float:
        return self.scale * (self.PER_ROW * rows * row_bytes + self.FIXED * self.parameter_bytes)

    def observe(self, rows: int, row_bytes: float, held: int) -> None:
        """A probe on ``rows`` rows held ``held`` bytes at its peak."""
        unscaled = self.predict(rows, row_bytes) / self.scale
        if unscaled > 0:
            self.scale = held / unscaled


def _batch_rows(batch: Any) -> int | None:
    """Leading size of the batch's first tensor with a dimension (None: the probes take it whole)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((rows for value in values if (rows := _batch_rows(value)) is not None), None)


def _leading_rows(batch: Any, rows: int) -> Any:
    """The first ``rows`` samples of every tensor in a batch (a graph batch stays whole)."""
    if isinstance(batch, torch.Tensor):
        return batch[:rows] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _leading_rows(v, rows) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_leading_rows(v, rows) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_leading_rows(v, rows) for v in batch)
    return batch


class _muted_logging:
    """Silence ``self.log`` while training_step runs for a probe (its values are not real)."""

    def __init__(self, module: pl.LightningModule):
        self.module = module

    def __enter__(self):
        self.module.log = lambda *args, **kwargs: None
        self.module.log_dict = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        del self.module.log
        del self.module.log_dict


def _is_compiled(pl_module: pl.LightningModule) -> bool:
    """Whether the module, or a submodule, trains compiled (``torch.compile`` or ``.compile()``)."""
    return getattr(pl_module, "_compiler_ctx", None) is not None or any(map(runs_compiled, pl_module.modules()))
