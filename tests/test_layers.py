"""The transformer against an independent float64 implementation and against Hugging Face's
XLM-R; every checkpoint layout; the failure modes of loading and converting."""
import os
import subprocess
import sys

import pytest
import torch

import layers
from conftest import (hf_config, naive_xlmr, padded_batch, random_hf_weights, write_fairseq, write_hf_dir,
                      write_safetensors)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # (layers, dim, heads, ffn, vocab): the tiny preset, and XLM-R base with a small vocabulary
    'tiny': (2, 32, 2, 64, 1000),
    'base': (12, 768, 12, 3072, 512),
}
SIZES = [pytest.param('tiny'), pytest.param('base', marks=pytest.mark.slow)]  # the fast tier checks the tiny one


def run(enc, mlm, ids):
    enc.eval()
    with torch.no_grad():
        h = enc(ids, ids.ne(1))
        return h, mlm(h)


@pytest.fixture(scope='module', params=SIZES)
def weights(request):
    cfg = hf_config(*SHAPES[request.param])
    return cfg, random_hf_weights(cfg, seed=len(request.param))


def check_same_as_naive(enc, mlm, sd, cfg):
    ids = padded_batch(cfg['vocab_size'], [17, 9, 3])  # padding included, compared at every position
    h, logits = run(enc, mlm, ids)
    ref_h, ref_logits = naive_xlmr(sd, cfg['num_attention_heads'], ids)
    assert (h.double() - ref_h).abs().max() <= 1e-4
    assert (logits.double() - ref_logits).abs().max() <= 1e-4


# every layout at the tiny size; XLM-R base's size in one (the readers do not depend on the size)
LAYOUTS = [('tiny', layout) for layout in ('safetensors', 'bin', 'fairseq-old', 'fairseq-new')] + [
    pytest.param('base', 'safetensors', marks=pytest.mark.slow)]


@pytest.mark.parametrize('weights,layout', LAYOUTS, indirect=['weights'])
def test_every_layout_matches_naive_implementation(weights, layout, tmp_path):
    cfg, sd = weights
    if layout.startswith('fairseq'):
        path = write_fairseq(sd, cfg, tmp_path / 'model.pt', new_style=layout.endswith('new'))
    else:
        path = write_hf_dir(sd, cfg, tmp_path / 'hf', fmt=layout)
    enc, mlm = layers.load_pretrained(path)[:2]
    assert (enc.cfg.n_layer, enc.cfg.dim, enc.cfg.n_head) == tuple(SHAPES['tiny' if cfg['hidden_size'] == 32 else 'base'][:3])
    check_same_as_naive(enc, mlm, sd, cfg)


@pytest.mark.parametrize('weights', ['tiny'], indirect=True)  # base's size is read in one layout above
def test_converted_checkpoint_gives_the_same_model(weights, tmp_path):
    cfg, sd = weights
    layers.main(['convert', write_hf_dir(sd, cfg, tmp_path / 'hf'), str(tmp_path / 'xlmr.pt')])
    enc, mlm = layers.load_pretrained(str(tmp_path / 'xlmr.pt'))[:2]
    check_same_as_naive(enc, mlm, sd, cfg)
    assert mlm.weight is enc.tok.weight  # the decoder stays tied after a round trip


def test_encoder_only_checkpoint_with_pooler(tmp_path):
    cfg = hf_config(*SHAPES['tiny'])
    sd = random_hf_weights(cfg)
    bare = {k[len('roberta.'):]: v for k, v in sd.items() if k.startswith('roberta.')}
    bare['pooler.dense.weight'], bare['pooler.dense.bias'] = torch.randn(32, 32), torch.randn(32)
    enc, mlm = layers.load_pretrained(write_hf_dir(bare, cfg, tmp_path, fmt='bin'))[:2]
    assert mlm is None
    ids = padded_batch(cfg['vocab_size'], [8, 5])
    with torch.no_grad():
        assert (enc.eval()(ids).double() - naive_xlmr(sd, 2, ids)[0]).abs().max() <= 1e-4


@pytest.mark.parametrize('shape', ['tiny'])  # a 12 x 768 model runs end to end in tests/test_bert.py
def test_same_as_huggingface_xlmr(shape, tmp_path):
    """The reference implementation itself, where the transformers test extra is installed."""
    transformers = pytest.importorskip('transformers')
    n_layer, dim, heads, ffn, vocab = SHAPES[shape]
    torch.manual_seed(0)
    ref = transformers.XLMRobertaForMaskedLM(transformers.XLMRobertaConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=n_layer, num_attention_heads=heads,
        intermediate_size=ffn, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1))
    with torch.no_grad():  # HF initialises LayerNorms and biases to 1 and 0: make them matter
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.eval().save_pretrained(tmp_path)
    enc, mlm = layers.load_pretrained(str(tmp_path))[:2]
    ids = padded_batch(vocab, [20, 11, 4])
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=ids.ne(1).long(), output_hidden_states=True)
    h, logits = run(enc, mlm, ids)
    assert (h - out.hidden_states[-1]).abs().max() <= 1e-4
    assert (logits - out.logits).abs().max() <= 1e-4


# ---------------------------------------------------------------------------------------
# The building blocks, checked against what they must compute.

def test_position_ids_follow_fairseq():
    ids = torch.tensor([[0, 5, 6, 2, 1, 1], [0, 7, 2, 1, 1, 1]])
    assert layers.position_ids(ids, 1).tolist() == [[2, 3, 4, 5, 1, 1], [2, 3, 4, 1, 1, 1]]


def test_run_composes_any_range_of_layers():
    torch.manual_seed(0)
    enc = layers.Encoder(layers.Config(vocab_size=50, n_layer=3, n_head=2, dim=16, ffn_dim=32)).eval()
    ids = padded_batch(50, [7, 4])
    mask = ids.ne(1)
    with torch.no_grad():
        x = enc.embed(ids)
        steps = enc.run(enc.run(enc.run(x, mask, 0, 1), mask, 1, 2), mask, 2)
        assert torch.allclose(steps, enc(ids), atol=1e-6)


def test_probability_path_equals_fast_path_and_ignores_padding():
    torch.manual_seed(0)
    attn = layers.Attention(layers.Config(n_head=4, dim=16)).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3]).bool()
    fast = attn(x, mask, memory=memory)
    slow, scores = attn(x, mask, memory=memory, return_scores=True)
    probs = scores.masked_fill(~mask[:, None, None, :], float('-inf')).softmax(-1)
    assert torch.allclose(fast, slow, atol=1e-5)
    assert probs.shape == (2, 4, 5, 7)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 5))
    assert probs[1, :, :, 4:].abs().max() == 0
    changed = memory.clone()
    changed[1, 4:] += 10  # padded memory positions must not matter
    assert torch.allclose(attn(x, mask, memory=changed), fast, atol=1e-6)


def test_causal_block_does_not_look_ahead_and_cross_attention_reads_memory():
    torch.manual_seed(0)
    cfg = layers.Config(n_head=2, dim=16, ffn_dim=32)
    block = layers.Block(cfg, cross=True).eval()
    x, memory = torch.randn(1, 6, 16), torch.randn(1, 4, 16)
    mask, memory_mask = torch.ones(1, 6, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)
    y = block(x, mask, memory, memory_mask, causal=True)
    later = x.clone()
    later[0, 4:] += 1.0
    y2 = block(later, mask, memory, memory_mask, causal=True)
    assert torch.allclose(y[0, :4], y2[0, :4], atol=1e-6) and not torch.allclose(y[0, 4:], y2[0, 4:])
    assert not torch.allclose(block(x, mask, memory + 1, memory_mask, causal=True), y)


def test_purely_causal_attention_runs_sdpas_causal_kernel_with_the_same_outputs(monkeypatch):
    """No padding mask and as many queries as keys: SDPA's is_causal, no mask built; the outputs are the masked ones."""
    torch.manual_seed(0)
    attn = layers.Attention(layers.Config(n_head=2, dim=16, ffn_dim=32)).eval()
    x, calls, sdpa = torch.randn(2, 6, 16), [], layers.F.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, 'scaled_dot_product_attention',
                        lambda *a, **k: (calls.append((k['attn_mask'] is None, k['is_causal'])), sdpa(*a, **k))[1])
    fast = attn(x, None, causal=True)
    masked = attn(x, torch.ones(2, 6, dtype=torch.bool), causal=True)
    slow, _ = attn(x, None, causal=True, return_scores=True)  # the attention written out, with the tril mask
    assert calls == [(True, True), (False, False)]
    assert torch.allclose(fast, masked, atol=1e-6) and torch.allclose(fast, slow, atol=1e-6)


def test_too_long_input_is_refused():
    enc = layers.Encoder(layers.CONFIGS['tiny'])
    with pytest.raises(ValueError, match='longer than the model'):
        enc(torch.full((1, 513), 5))


# ---------------------------------------------------------------------------------------
# Wrong checkpoints fail with one line that names the problem.

@pytest.fixture
def tiny_bin(tmp_path):
    cfg = hf_config(*SHAPES['tiny'])
    return cfg, random_hf_weights(cfg), tmp_path


def one_line_error(path):
    with pytest.raises(layers.CheckpointError) as err:
        layers.load_pretrained(str(path))
    assert '\n' not in str(err.value)
    return str(err.value)


def test_missing_key(tiny_bin):
    cfg, sd, tmp = tiny_bin
    del sd['roberta.encoder.layer.1.output.dense.bias']
    assert 'missing: enc.blocks.1.ffn.fc2.bias' in one_line_error(write_hf_dir(sd, cfg, tmp, fmt='bin'))


def test_unexpected_key(tiny_bin):
    cfg, sd, tmp = tiny_bin
    sd['classifier.dense.weight'] = torch.zeros(3, 32)
    assert 'unexpected: classifier.dense.weight' in one_line_error(write_hf_dir(sd, cfg, tmp, fmt='bin'))


def test_wrong_shape(tiny_bin):
    cfg, sd, tmp = tiny_bin
    sd['roberta.encoder.layer.0.intermediate.dense.bias'] = torch.zeros(65)
    msg = one_line_error(write_hf_dir(sd, cfg, tmp, fmt='bin'))
    assert 'wrong shape: enc.blocks.0.ffn.fc1.bias [65] (model [64])' in msg


def test_untied_decoder_is_refused(tiny_bin):
    cfg, sd, tmp = tiny_bin
    sd['lm_head.decoder.weight'] = sd['lm_head.decoder.weight'] + 1
    assert 'differs from enc.tok.weight' in one_line_error(write_hf_dir(sd, cfg, tmp, fmt='bin'))
    state = torch.load(write_fairseq(random_hf_weights(cfg), cfg, tmp / 'model.pt'), weights_only=False)
    state['model']['decoder.lm_head.weight'] = state['model']['decoder.lm_head.weight'] + 1  # fairseq's copy
    torch.save(state, tmp / 'model.pt')
    assert 'differs from enc.tok.weight' in one_line_error(tmp / 'model.pt')


class Payload:
    def __reduce__(self):
        return (os.system, ('echo pwned > /dev/null',))


class Plain:
    pass


@pytest.mark.parametrize('obj', [Payload(), Plain()], ids=['os.system', 'plain-object'])
def test_pickled_objects_are_refused(tiny_bin, obj):
    cfg, sd, tmp = tiny_bin
    torch.save({'model': sd, 'args': obj}, tmp / 'model.pt')
    msg = one_line_error(tmp / 'model.pt')
    assert 'not allowed' in msg and ('posix.system' in msg or 'Plain' in msg or 'os.system' in msg)


def test_safetensors_header_is_checked(tmp_path):
    (tmp_path / 'model.safetensors').write_bytes(b'\x05\x00\x00\x00\x00\x00\x00\x00nope!')
    (tmp_path / 'config.json').write_text('{}')
    assert 'not a safetensors file' in one_line_error(tmp_path)
    (tmp_path / 'model.safetensors').write_bytes(b'\x05\x00')
    assert 'not a safetensors file' in one_line_error(tmp_path)
    write_safetensors({'a': torch.randn(64)}, tmp_path / 'model.safetensors')
    data = (tmp_path / 'model.safetensors').read_bytes()
    (tmp_path / 'model.safetensors').write_bytes(data[:-16])  # truncated
    assert 'ends past the file' in one_line_error(tmp_path)


def test_convert_interrupted_leaves_nothing(tiny_bin, monkeypatch):
    cfg, sd, tmp = tiny_bin
    src = write_hf_dir(sd, cfg, tmp / 'hf', fmt='bin')
    out = tmp / 'out.pt'
    out.write_bytes(b'previous file')

    def dies_half_way(obj, f):
        f.write(b'half a checkpoint')
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, 'save', dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        layers.main(['convert', src, str(out)])
    assert out.read_bytes() == b'previous file'
    assert sorted(os.listdir(tmp)) == ['hf', 'out.pt']


@pytest.mark.slow
def test_convert_command_prints_one_line(tiny_bin):
    cfg, sd, tmp = tiny_bin
    del sd['roberta.embeddings.LayerNorm.weight']
    src = write_hf_dir(sd, cfg, tmp, fmt='bin')
    res = subprocess.run([sys.executable, 'layers.py', 'convert', src, str(tmp / 'o.pt')], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.count('\n') == 1
    assert res.stderr.startswith('error: ') and 'missing: enc.ln.weight' in res.stderr
    assert not os.path.exists(tmp / 'o.pt')


def test_safetensors_reader_dtypes(tmp_path):
    sd = {'a': torch.randn(3, 4), 'b': torch.randn(5).half(), 'c': torch.randn(2, 2).bfloat16(), 'd': torch.arange(6)}
    write_safetensors(sd, tmp_path / 'x.safetensors')
    back = layers.read_safetensors(str(tmp_path / 'x.safetensors'))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_a_checkpoint_holds_each_storage_once_and_loads_with_its_ties(tmp_path):
    """The writer's host copy keeps tensors that share a storage together: the MLM head's weight tied to the word
    embeddings, and best.pt's encoder beside the method that holds it. The file holds the parameters' bytes once (and
    a few KB of index), and its tensors load sharing their storage as they did."""
    cfg = layers.Config(vocab_size=1000, n_layer=2, n_head=2, dim=32, ffn_dim=64)
    encoder = layers.Encoder(cfg)
    method = torch.nn.ModuleDict({'encoder': encoder, 'mlm': layers.MLMHead(cfg, encoder.tok.weight)})
    writer, path = layers.Writer(), str(tmp_path / 'best.pt')
    writer.save(path, {'task': 'xnli'}, method=method.state_dict(), encoder=encoder.state_dict())
    writer.wait()
    tensors = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in method.state_dict().values()}
    assert sum(tensors.values()) <= os.path.getsize(path) <= sum(tensors.values()) + 64_000
    ckpt = layers.load_checkpoint(path)
    address = lambda t: t.untyped_storage().data_ptr()
    tied = [ckpt['method']['mlm.weight'], ckpt['method']['encoder.tok.weight'], ckpt['encoder']['tok.weight']]
    assert len({address(t) for t in tied}) == 1 and torch.equal(tied[0], encoder.tok.weight)
    assert all(torch.equal(ckpt['method'][k], v) for k, v in method.state_dict().items())
