"""``tba.integrations.hf.TensorCacheCallback`` in a real ``transformers.Trainer`` (tiny GPT-2,
CPU): bit-identical to the same Trainer run without tba, bytes really offloaded and reloaded,
tba's stats in the Trainer's logs, the cache closed when training ends."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests import models

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="transformers/accelerate are not installed (pip install 'tba[hf]')",
)

NUM_STEPS = 3
OPTIONS = dict(offload_devices="cpu", min_offload_bytes=0, adaptive=False)


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return NUM_STEPS * models.BATCH

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, models.VOCAB, (models.SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _train(tmp_path, callbacks: list, make_model=models.gpt2,
           **training_args) -> tuple[torch.nn.Module, list, list]:
    """Three AdamW steps of a tiny GPT-2 (dropout on) through Trainer; the model, every
    step's gradients (read before the optimizer step) and the log history."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    grads: list[dict[str, torch.Tensor]] = []

    class RecordGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    set_seed(0)
    model = make_model()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=NUM_STEPS, per_device_train_batch_size=models.BATCH,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-3, **training_args,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=_Batches(), callbacks=[*callbacks, RecordGrads()]
    )
    trainer.train()
    return model, grads, trainer.state.log_history


def _settle_stores(callback, seen_caches: list | None = None):
    """A TrainerCallback (after ``callback``) that, at train begin, hooks the end of the model's
    forward to complete every store of ``callback``'s cache before Trainer calls backward, so
    backward really reloads from the offloader, however busy the machine; it also remembers the
    live cache in ``seen_caches``."""
    from transformers import TrainerCallback

    def wait_for_stores(module, args, output):
        if callback.cache is not None:
            if seen_caches is not None:
                seen_caches.append(callback.cache)
            callback.cache.wait_for_stores(timeout_s=60)

    class SettleStores(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.register_forward_hook(wait_for_stores)

    return SettleStores()


def test_trainer_callback_is_bit_exact_and_logs_stats(tmp_path):
    from transformers import TrainerCallback

    from tba.integrations.hf import TensorCacheCallback

    callback = TensorCacheCallback(**OPTIONS)
    seen_caches: list = []
    reference, ref_grads, ref_logs = _train(tmp_path / "ref", [])
    seen_logs = []

    class RecordLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen_logs.append(dict(logs))  # what callbacks after ours (reporters) receive

    settle = _settle_stores(callback, seen_caches)
    model, grads, logs = _train(tmp_path / "tba", [callback, settle, RecordLogs()])

    assert len(grads) == len(ref_grads) == NUM_STEPS
    for step, (want, have) in enumerate(zip(ref_grads, grads)):
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name]), f"step {step}: grad of {name} differs"
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs after training"
    ref_losses = [e["loss"] for e in ref_logs if "loss" in e]
    step_logs = [e for e in logs if "loss" in e]
    assert [e["loss"] for e in step_logs] == ref_losses and len(step_logs) == NUM_STEPS

    # tba's numbers are in every step's log, and bytes really went out and came back.
    for entry in step_logs:
        assert entry["tba/offloaded_bytes"] > 0 and entry["tba/reloaded_bytes"] > 0, entry
        assert entry["tba/num_io_errors"] == 0, entry
    passed_on = [e for e in seen_logs if "loss" in e]
    assert len(passed_on) == NUM_STEPS and all(e["tba/offloaded_bytes"] > 0 for e in passed_on)
    # Configured on the model at train begin, closed at train end.
    assert seen_caches and seen_caches[0].model is model
    assert callback.cache is None and seen_caches[0]._closed


def test_bad_options_fail_when_the_callback_is_made():
    from tba.integrations.hf import TensorCacheCallback

    with pytest.raises(ValueError, match="min_offload_bytes=-1"):
        TensorCacheCallback(min_offload_bytes=-1)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_peft_lora_through_trainer_is_bit_exact(tmp_path):
    """A LoRA-wrapped GPT-2 (frozen base weights, whose transposes linear saves, must stay in
    memory like any parameter) through the callback: bit-exact, bytes offloaded."""
    from peft import LoraConfig, get_peft_model

    from tba.integrations.hf import TensorCacheCallback

    def lora():
        return get_peft_model(
            models.gpt2(), LoraConfig(r=4, target_modules=["c_attn", "c_fc"], lora_dropout=0.1)
        )

    callback = TensorCacheCallback(**OPTIONS)
    reference, ref_grads, _ = _train(tmp_path / "ref", [], make_model=lora)
    model, grads, logs = _train(tmp_path / "tba", [callback, _settle_stores(callback)], make_model=lora)
    assert ref_grads and len(grads) == len(ref_grads)
    for step, (want, have) in enumerate(zip(ref_grads, grads)):
        assert want.keys() == have.keys() and all("lora_" in n for n in want)
        for name in want:
            assert torch.equal(want[name], have[name]), f"step {step}: grad of {name} differs"
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs after training"
    # Every step's stores completed before its backward: bytes went out and came back.
    step_logs = [e for e in logs if "loss" in e]
    assert len(step_logs) == NUM_STEPS, logs
    assert all(e["tba/offloaded_bytes"] > 0 and e["tba/reloaded_bytes"] > 0 for e in step_logs), logs


@pytest.mark.slow
def test_trainer_with_a_model_compiled_with_backend_tba_is_bit_exact(tmp_path):
    """A model compiled with ``torch.compile(model, backend="tba")`` handed to the Trainer
    with the callback (which configures the model inside the compiled wrapper): equal to the
    same Trainer run with the model compiled by ``backend="inductor"``, bytes offloaded.
    (``TrainingArguments(torch_compile_backend="tba")`` stops in accelerate 1.15, whose
    ``DynamoBackend`` lists the backends it knows: docs/integrations.md.) Both run with
    deterministic algorithms: Inductor's CPU embedding gradient adds with atomics otherwise
    (``tests/compile/training.py``, ``deterministic``)."""
    import torch._dynamo

    from tba.integrations.hf import TensorCacheCallback
    from tests.compile.training import deterministic

    def compiled(backend: str):
        def make() -> torch.nn.Module:
            model = models.gpt2()
            model.loss_type = "ForCausalLM"  # transformers' warning would break the graph
            return torch.compile(model, backend=backend)
        return make

    torch._dynamo.reset()
    # The compiled wrapper's forward takes (*args, **kwargs): keep the dataset's columns.
    with deterministic():
        _, ref_grads, ref_logs = _train(tmp_path / "ref", [], make_model=compiled("inductor"),
                                        remove_unused_columns=False)
        torch._dynamo.reset()
        callback = TensorCacheCallback(**OPTIONS)
        _, grads, logs = _train(tmp_path / "tba", [callback, _settle_stores(callback)],
                                make_model=compiled("tba"), remove_unused_columns=False)
    torch._dynamo.reset()
    assert len(grads) == len(ref_grads) == NUM_STEPS
    for step, (want, have) in enumerate(zip(ref_grads, grads)):
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name]), f"step {step}: grad of {name} differs"
    assert [e["loss"] for e in logs if "loss" in e] == [e["loss"] for e in ref_logs if "loss" in e]
    step_logs = [e for e in logs if "loss" in e]
    assert len(step_logs) == NUM_STEPS, logs
    assert all(e["tba/offloaded_bytes"] > 0 and e["tba/reloaded_bytes"] > 0 for e in step_logs), logs
