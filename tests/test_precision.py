"""--precision: fp16 with a loss scaler, bf16 and fp32 on the CPU (where torch's autocast has both), the default
each device gets, and exact fp32 where a GPU would otherwise use TF32."""
import json

import pytest
import torch

import layers
import xlt
from conftest import demo_run


def test_each_device_gets_its_default(monkeypatch):
    assert layers.default_precision('cpu') == 'fp32'
    for native, expected in ((True, 'bf16'), (False, 'fp16')):  # an A100 and a V100
        monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: native)
        assert layers.default_precision('cuda') == expected


def test_autocast_and_exact_fp32():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    cpu = torch.device('cpu')
    with layers.autocast(cpu, 'bf16'):
        assert (x @ w).dtype == torch.bfloat16
        with layers.exact_fp32(cpu):  # the released translation inference: fp32, whatever surrounds it
            assert (x @ w).dtype == torch.float32
    with layers.autocast(cpu, 'fp16'):
        assert (x @ w).dtype == torch.float16
    with layers.autocast(cpu, 'fp32'):
        assert (x @ w).dtype == torch.float32
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    with layers.exact_fp32(cpu):
        assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = before


class Overflow(torch.autograd.Function):
    """The identity forward; backward, an infinite gradient: an fp16 overflow planted at one step."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float('inf')


@pytest.mark.slow
def test_fp16_skips_an_overflowing_step_and_logs_it_and_fp32_trains(tmp_path, monkeypatch):
    """At step 5 the gradients overflow: the scaler skips that step (the weights stay as they were) and halves its
    scale, the log counts it, and the run goes on to finite losses; fp32 trains the same demo."""
    import data
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=64, n_eval=8)
    predict = xlt.Baseline.predict
    seen = {}

    def planted(self, batch):
        logits = predict(self, batch)
        if self.training and self.step == 4:  # the fifth step's forward
            seen['before'] = self.head.out.weight.detach().clone()
            return Overflow.apply(logits)
        if self.training and self.step == 5 and 'after' not in seen:
            seen['after'] = self.head.out.weight.detach().clone()
        return logits
    monkeypatch.setattr(xlt.Baseline, 'predict', planted)
    argv = ['--task', 'xnli', '--epochs', '1', '--batch_size', '8', '--log_every', '1']
    get_scale = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, 'get_scale', lambda self: pytest.fail('get_scale: a host sync a step'))
    demo_run(tmp_path / 'fp16', demo, argv + ['--precision', 'fp16'])  # the step compares the scale on the device
    monkeypatch.setattr(torch.amp.GradScaler, 'get_scale', get_scale)
    log = [json.loads(line) for line in open(tmp_path / 'fp16' / 'log.jsonl')]
    skipped = [line['step'] for line in log if line.get('skipped')]
    assert skipped == [5] and all(torch.isfinite(torch.tensor(line['loss'])) for line in log if 'loss' in line)
    assert torch.equal(seen['before'], seen['after'])  # the overflowing step changed nothing
    assert json.load(open(tmp_path / 'fp16' / 'config.json'))['precision'] == 'fp16'
    monkeypatch.setattr(xlt.Baseline, 'predict', predict)
    demo_run(tmp_path / 'fp32', demo, argv + ['--precision', 'fp32'])
    log = [json.loads(line) for line in open(tmp_path / 'fp32' / 'log.jsonl')]
    assert not any('skipped' in line for line in log) and all(line['loss'] < 2 for line in log if 'loss' in line)
