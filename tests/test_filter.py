"""FILTER: the degenerate settings of its Figure 2, the self-teaching KL term, and the method
end to end on the demo data."""
import argparse
import json
import os

import pytest
import torch

import data
import layers
import train
import xlt
from conftest import padded_batch
from test_train import eval_cli, run


def filter_model(n_layer, m, k, task='xnli'):
    torch.manual_seed(0)
    enc = layers.Encoder(layers.Config(vocab_size=60, n_layer=n_layer, n_head=2, dim=16, ffn_dim=32))
    return xlt.Filter(enc, task, argparse.Namespace(m=m, k=k, kl_weight=None)).eval()


def pair_batch():
    src, tgt = padded_batch(60, [9, 5], seed=1), padded_batch(60, [4, 7, 6][:2], seed=2)
    return data.Pair(data.Batch(src, src.ne(1)), data.Batch(tgt, tgt.ne(1)))


def test_all_local_layers_is_the_encoder_on_each_side():
    f, p = filter_model(3, m=3, k=0), pair_batch()
    with torch.no_grad():
        h_s, h_t = f.encode(p.src, p.tgt)
        assert (h_s - f.encoder(p.src.ids, p.src.mask)).abs().max() <= 1e-6
        assert (h_t - f.encoder(p.tgt.ids, p.tgt.mask)).abs().max() <= 1e-6


def test_all_fusion_layers_is_the_encoder_on_the_concatenation():
    f, p = filter_model(3, m=0, k=3), pair_batch()
    enc = f.encoder
    with torch.no_grad():
        h_s, h_t = f.encode(p.src, p.tgt)
        x = torch.cat([enc.embed(p.src.ids), enc.embed(p.tgt.ids)], 1)  # positions from each sequence's start
        whole = enc.run(x, torch.cat([p.src.mask, p.tgt.mask], 1))
        assert (torch.cat([h_s, h_t], 1) - whole).abs().max() <= 1e-6
        naive = enc(torch.cat([p.src.ids, p.tgt.ids], 1))  # one sequence: positions run on, padding attended
        assert (torch.cat([h_s, h_t], 1) - naive).abs().max() > 1e-3


def test_local_fusion_domain_stacking_by_hand():
    f, p = filter_model(3, m=1, k=1), pair_batch()
    enc, (s, t) = f.encoder, (p.src, p.tgt)
    with torch.no_grad():
        local_s, local_t = enc.blocks[0](enc.embed(s.ids), s.mask), enc.blocks[0](enc.embed(t.ids), t.mask)
        fused = enc.blocks[1](torch.cat([local_s, local_t], 1), torch.cat([s.mask, t.mask], 1))
        fs, ft = fused[:, :s.ids.size(1)], fused[:, s.ids.size(1):]
        h_s, h_t = f.encode(s, t)
        assert (h_s - enc.blocks[2](fs, s.mask)).abs().max() <= 1e-6
        assert (h_t - enc.blocks[2](ft, t.mask)).abs().max() <= 1e-6


def test_k_plus_m_beyond_the_depth_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not fit the model's 3 layers"):
        filter_model(3, m=2, k=2)
    with pytest.raises(SystemExit, match=r"error: --k 3 \+ --m 1 does not fit the model's 2 layers"):
        train.main(['--method', 'filter', '--demo', '--k', '3', '--out', str(tmp_path)])


@pytest.mark.parametrize('task', ['xnli', 'panx', 'xquad'])
def test_kl_is_against_stored_target_probabilities(task):
    f = filter_model(2, m=1, k=1, task=task)
    n_labels = len(data.TASKS[task].labels)
    g = torch.Generator().manual_seed(0)
    p = pair_batch()
    family = data.TASKS[task].family
    if family == 'classification':
        labels = torch.tensor([0, 2])
        p.src.labels = p.tgt.labels = labels
    elif family == 'tagging':
        p.src.labels = torch.where(p.src.mask, 1, data.IGNORE)
        p.tgt.first = p.tgt.mask.clone()
    else:
        p.src.labels = p.tgt.labels = torch.tensor([[1, 2], [1, 1]])
    p.tgt.index = [1, 0]
    with torch.no_grad():
        logits = f.predict(p)  # target side
    lengths = p.tgt.mask.sum(1).tolist()
    own = [xlt.probabilities(family, (logits[i] if family == 'classification' else logits[i, :lengths[i]]))
           for i in range(2)]
    f.p_teacher = [own[1], own[0]]  # stored by item index: batch row r is item index[r]
    f.lam = 0.5
    with torch.no_grad():
        _, logs = f.loss(p)
    assert abs(logs['kl']) < 1e-6  # the student predicts what the teacher did
    # another teacher: the KL is sum p log(p / q) over the target side, by hand
    other = [torch.rand(o.shape, generator=g) for o in own]
    other = [o / o.sum(0 if family == 'qa' else -1, keepdim=True) for o in other]
    f.p_teacher = [other[1], other[0]]
    with torch.no_grad():
        _, logs = f.loss(p)
    expected = []
    for i in range(2):
        q = own[i]
        kl = (other[i] * (other[i].log() - q.log())).sum(0 if family == 'qa' else -1)
        expected.append(kl)
    if family == 'tagging':  # the mean over the batch's words
        expected = torch.cat(expected).sum() / sum(lengths)
    else:
        expected = torch.stack([e.mean() for e in expected]).mean()
    assert logs['kl'].item() == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.slow
def test_self_teaching_end_to_end(tmp_path, capsys):
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=150, n_eval=30)
    results = run(tmp_path / 'st', demo, '--method', 'filter', '--task', 'xnli', '--self_teach', '--epochs', '3')
    teacher, stored = tmp_path / 'st' / 'teacher', tmp_path / 'st' / 'p_teacher.pt'
    printed = capsys.readouterr().out  # each stage says what it is, in its banner and its table
    assert printed.index(f'filter on xnli (student) in {tmp_path / "st"}: a new run') \
        < printed.index(f'filter on xnli (teacher) in {teacher}: a new run') < printed.index('dev (xnli, teacher)') \
        < printed.index('dev (xnli, student)')
    probs = torch.load(stored, weights_only=True)  # a data.Ragged: item i's probabilities are probs[i]
    assert isinstance(probs, data.Ragged)
    pairs = 150 + sum(t is not None for lang in ('de', 'zh') for _, t in data.read_translations(demo, 'xnli', 'train', lang))
    assert len(probs) == pairs and all(torch.allclose(p.sum(), torch.tensor(1.0)) for p in probs)  # (en, en), (en, de), (en, zh)
    assert os.path.exists(teacher / 'results.json') and os.path.exists(tmp_path / 'st' / 'results.json')
    logged = [json.loads(line) for line in open(tmp_path / 'st' / 'log.jsonl')]
    assert all('kl' in r for r in logged if 'loss' in r) and not any('kl' in json.loads(l) for l in open(teacher / 'log.jsonl'))
    # written once: a resumed student reads the stored probabilities back
    stamp = stored.stat().st_mtime_ns
    run(tmp_path / 'st', demo, '--method', 'filter', '--task', 'xnli', '--self_teach', '--epochs', '3', '--resume')
    assert stored.stat().st_mtime_ns == stamp
    # the student alone, from the finished teacher: the same probabilities, the same student
    again = run(tmp_path / 'student', demo, '--method', 'filter', '--task', 'xnli', '--teacher', str(teacher), '--epochs', '3')
    assert all(torch.equal(a, b) for a, b in zip(probs, torch.load(tmp_path / 'student' / 'p_teacher.pt', weights_only=True)))
    assert again['test'] == pytest.approx(results['test'])
    scores = eval_cli(tmp_path / 'st', demo)['xnli']
    assert results['test'] == pytest.approx({**scores['accuracy'], 'avg': scores['avg_accuracy'],
                                             'gap': results['test']['gap']}, abs=1e-9)
    assert results['dev']['en'] > 40
    # a new run (not --resume) predicts its stored probabilities again, whatever the folder held
    (tmp_path / 'redo').mkdir()
    torch.save(data.Ragged(probs.values[:30], probs.ends[:11]), tmp_path / 'redo' / 'p_teacher.pt')  # 10 items'
    run(tmp_path / 'redo', demo, '--method', 'filter', '--task', 'xnli', '--teacher', str(teacher), '--epochs', '1')
    assert len(torch.load(tmp_path / "redo" / "p_teacher.pt", weights_only=True)) == pairs
    with pytest.raises(SystemExit, match='is a run of xnli, not panx'):
        run(tmp_path / 'other', demo, '--method', 'filter', '--task', 'panx', '--teacher', str(teacher), '--epochs', '1')


@pytest.mark.parametrize('task,T', [('xnli', 1.0), ('xnli', 2.0), ('panx', 1.0), ('mlqa', 3.0)])
def test_filter_loss_is_eq_6_by_hand(task, T):
    """Teacher L_s + L_t (tagging: L_s alone); student L_s + lambda L_t + (1 - lambda) KL (Eq. 6,
    lambda = 1 - the KL weight, 0 for tagging), the KL of the teacher's and the student's distributions
    softened by T, times T^2, from the teacher's logits by hand."""
    from test_xmixup import ce, kl, labelled_side
    family, n_labels = data.TASKS[task].family, max(2, len(data.TASKS[task].labels))
    f = filter_model(3, m=1, k=1, task=task)
    f.temperature = T
    src, tgt = labelled_side(family, [9, 5, 7], 1, n_labels), labelled_side(family, [4, 7, 8], 2, n_labels)
    lengths = tgt.mask.sum(1).tolist()
    g = torch.Generator().manual_seed(7)
    z = [torch.randn(n, n_labels if family == 'tagging' else 2, generator=g) * 2 for n in lengths]
    if family == 'classification':
        z = [torch.randn(n_labels, generator=g) * 2 for _ in lengths]
    with torch.no_grad():
        h_s, h_t = f.encode(src, tgt)
        z_s, z_t = f.head(h_s, src.mask), f.head(h_t, tgt.mask)
    if family == 'tagging':  # token means over the batch
        labelled = src.labels.ne(data.IGNORE)
        L_s = sum(ce(z_s[i, j], src.labels[i, j]) for i, j in labelled.nonzero().tolist()) / labelled.sum()
        L_t = 0.0
        KL = sum(kl((z[i][j] / T).softmax(-1), (z_t[i, j] / T).softmax(-1)) for i, j in tgt.first.nonzero().tolist())
        KL = KL * T ** 2 / tgt.first.sum()
        lam = 0.0
    else:
        if family == 'classification':
            per = lambda zz, y: ce(zz, y)
            kls = [kl((z[i] / T).softmax(-1), (z_t[i] / T).softmax(-1)) for i in range(3)]
        else:  # start and end: distributions over the target's positions, averaged
            per = lambda zz, y: (ce(zz[:, 0], y[0]) + ce(zz[:, 1], y[1])) / 2
            kls = [sum(kl((z[i][:, e] / T).softmax(0), (z_t[i, :lengths[i], e] / T).softmax(0)) for e in (0, 1)) / 2
                   for i in range(3)]
        L_s = sum(per(z_s[i], src.labels[i]) for i in range(3)) / 3
        L_t = sum(per(z_t[i], tgt.labels[i]) for i in range(3)) / 3
        KL = sum(kls) * T ** 2 / 3
        lam = 1 - {'classification': 0.5, 'qa': 0.1}[family]  # the paper's KL weights 1 - lambda
    with torch.no_grad():
        teacher = f.loss(data.Pair(src, tgt))[0]
        f.p_teacher = [xlt.probabilities(family, zz) for zz in z]  # what a teacher stores: T = 1 probabilities
        student = f.loss(data.Pair(src, tgt))[0]
    assert teacher.item() == pytest.approx(float(L_s + L_t), rel=1e-4)
    assert student.item() == pytest.approx(float(L_s + lam * L_t + (1 - lam) * KL), rel=1e-4)


# ---------------------------------------------------------------------------------------
# FILTER's released models (its download_data.sh's phase1/ and phase2/ folders), in their layout.

LAYER = (('attention.self.query', 'DD'), ('attention.self.key', 'DD'), ('attention.self.value', 'DD'),
         ('attention.output.dense', 'DD'), ('attention.output.LayerNorm', 'D'), ('intermediate.dense', 'FD'),
         ('output.dense', 'DF'), ('output.LayerNorm', 'D'))  # transformers 2.5.1's BertLayer, a weight and a bias each


def filter_release(folder, vocab, m, k, n_layer=4, dim=32, ffn=64, heads=4, kind='classification', labels=3,
                   task='xnli'):
    """A random FILTER model as FILTER's runners save it (yuwfan/FILTER 6dac390, modeling_xlm_roberta.py): FilterModel
    is RobertaModel's embeddings, m local layers filter.encoder.layer.i, k fusion layers filter.fusion.j, the rest
    filter.domain.j, and its pooler; FilterForSequenceClassification's output = Sequential(Dropout, Linear, ReLU,
    Dropout, Linear), the tagging model's classifier, the QA model's qa_outputs. config.json as run_xcls.py leaves it
    (num_hidden_layers = m, filter_m, filter_k, id2label LABEL_i: two of them whatever the label count, as
    transformers 2.5.1's PretrainedConfig builds it before num_labels is set; pad_token_id null, as 2.5.1 writes
    it where the hub's config has none); pytorch_model.bin in torch's legacy format."""
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    size = {'D': dim, 'F': ffn}
    sd = {'filter.embeddings.word_embeddings.weight': r(vocab, dim), 'filter.embeddings.position_embeddings.weight':
          r(514, dim), 'filter.embeddings.token_type_embeddings.weight': r(1, dim),
          'filter.embeddings.LayerNorm.weight': 1 + r(dim), 'filter.embeddings.LayerNorm.bias': r(dim),
          'filter.pooler.dense.weight': r(dim, dim), 'filter.pooler.dense.bias': r(dim)}
    groups = [('filter.encoder.layer', m), ('filter.fusion', k), ('filter.domain', n_layer - m - k)]
    for group, n in groups:
        for i in range(n):
            for name, shape in LAYER:
                sd[f'{group}.{i}.{name}.weight'] = r(*(size[c] for c in shape))
                sd[f'{group}.{i}.{name}.bias'] = r(size[shape[0]])
    head = {'classification': {'output.1': (dim, dim), 'output.4': (labels, dim)}, 'tagging': {'classifier': (labels, dim)},
            'qa': {'qa_outputs': (2, dim)}}[kind]
    for name, shape in head.items():
        sd[f'{name}.weight'], sd[f'{name}.bias'] = r(*shape), r(shape[0])
    arch = {'classification': 'FilterForSequenceClassification', 'tagging': 'FilterForTokenClassification',
            'qa': 'FilterForQuestionAnswering'}[kind]
    config = {'architectures': [arch], 'model_type': 'xlm-roberta', 'vocab_size': vocab, 'hidden_size': dim,
              'num_hidden_layers': m, 'num_attention_heads': heads, 'intermediate_size': ffn, 'hidden_act': 'gelu',
              'max_position_embeddings': 514, 'type_vocab_size': 1, 'layer_norm_eps': 1e-5, 'pad_token_id': None,
              'filter_m': m, 'filter_k': k, 'alpha': 0.0, 'temperature': 0.1, 'output_hidden_states': True,
              'finetuning_task': task, 'num_labels': labels, 'id2label': {str(i): f'LABEL_{i}' for i in range(2)}}
    os.makedirs(folder, exist_ok=True)
    (folder / 'config.json').write_text(json.dumps(config))
    torch.save(sd, folder / 'pytorch_model.bin', _use_new_zipfile_serialization=False)
    return sd


def test_filters_released_model_loads_every_tensor_in_its_place_and_its_head_is_dense_relu_dense(tmp_path):
    sd = filter_release(tmp_path / 'phase1', vocab=50, m=1, k=2)
    enc, mlm = layers.load_pretrained(str(tmp_path / 'phase1'))[:2]  # strict: every tensor of the file accounted for
    assert mlm is None and enc.cfg.n_layer == 4 and enc.task_head.fusion == (1, 2)
    assert enc.cfg.pad_id == 1  # pad_token_id null: XLM-R's padding
    assert enc.task_head.labels == ['contradiction', 'entailment', 'neutral']  # two LABEL_i: finetuning_task's order
    blocks = enc.state_dict()
    for ours, theirs in ((0, 'filter.encoder.layer.0'), (1, 'filter.fusion.0'), (2, 'filter.fusion.1'),
                         (3, 'filter.domain.0')):  # the local, fusion and domain layers in XLM-R's order
        assert torch.equal(blocks[f'blocks.{ours}.ffn.fc1.weight'], sd[f'{theirs}.intermediate.dense.weight'])
        assert torch.equal(blocks[f'blocks.{ours}.attn.qkv.weight'], torch.cat(
            [sd[f'{theirs}.attention.self.{x}.weight'] for x in ('query', 'key', 'value')]))
    assert torch.equal(blocks['pos.weight'], sd['filter.embeddings.position_embeddings.weight']
                       + sd['filter.embeddings.token_type_embeddings.weight'][0])
    f = xlt.Filter(enc, 'xnli', argparse.Namespace(m=None, k=2, kl_weight=None)).eval()
    p = pair_batch()
    p = data.Pair(data.Batch(p.src.ids % 50, p.src.mask), data.Batch(p.tgt.ids % 50, p.tgt.mask))
    with torch.no_grad():
        h_t = f.encode(p.src, p.tgt, source_side=False)[1][:, 0]  # the target's <s>, where FILTER's runners read
        relu = (h_t @ sd['output.1.weight'].T + sd['output.1.bias']).clamp(min=0)
        by_hand = relu @ sd['output.4.weight'].T + sd['output.4.bias']  # LABEL_i: xglue.py's XNLI order, ours too
        assert (f.predict(p) - by_hand).abs().max() <= 1e-5
        tanh = torch.tanh(h_t @ sd['output.1.weight'].T + sd['output.1.bias']) @ sd['output.4.weight'].T
        assert (f.predict(p) - tanh - sd['output.4.bias']).abs().max() > 1e-3  # RoBERTa's head would differ
    taken = xlt.Filter(enc, 'xnli', argparse.Namespace(m=None, k=None, kl_weight=None))  # its config.json's m and k
    assert (taken.m, taken.k) == (1, 2)
    with pytest.raises(ValueError, match='--init is FILTER fine-tuned with m = 1, k = 2: drop --m and --k'):
        xlt.Filter(enc, 'xnli', argparse.Namespace(m=1, k=1, kl_weight=None))
    with pytest.raises(ValueError, match='--init is FILTER\'s released model: run it with --method filter'):
        xlt.Baseline(enc, 'xnli')


def test_filters_released_tagging_and_qa_models_load_and_a_short_file_is_refused(tmp_path):
    for kind, task, labels in (('tagging', 'panx', len(data.TASKS['panx'].labels)), ('qa', 'xquad', 2)):
        sd = filter_release(tmp_path / kind, vocab=50, m=1, k=1, kind=kind, labels=labels, task=task)
        config = json.loads((tmp_path / kind / 'config.json').read_text())
        config['id2label'] = dict(enumerate(data.TASKS[task].labels)) if kind == 'tagging' else {}
        (tmp_path / kind / 'config.json').write_text(json.dumps(config))
        enc, _ = layers.load_pretrained(str(tmp_path / kind))[:2]
        f = xlt.Filter(enc, task, argparse.Namespace(m=None, k=1, kl_weight=None))  # QA's 20 scaled to 4 layers: 3
        out = 'classifier' if kind == 'tagging' else 'qa_outputs'
        assert torch.equal(f.head.out.weight, sd[f'{out}.weight']) and torch.equal(f.head.out.bias, sd[f'{out}.bias'])
        with pytest.raises(ValueError, match='--init is FILTER\'s released model: run it with --method filter'):
            xlt.Baseline(enc, task)  # its layers were fine-tuned fused
    config = json.loads((tmp_path / 'qa' / 'config.json').read_text())
    (tmp_path / 'qa' / 'config.json').write_text(json.dumps({**config, 'filter_k': 2}))  # a fusion layer short
    with pytest.raises(layers.CheckpointError, match='holds 1 filter.fusion layers where its config.json says 2'):
        layers.load_pretrained(str(tmp_path / 'qa'))


def test_a_released_filter_model_evaluates_and_predicts_from_the_command_line(tmp_path):
    """--init FILTER's released folder with --eval_only scores it in every language, and --predict then predicts a
    file with the same model: the released tables by inference alone."""
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=20, n_eval=8)
    vocab = data.Tokenizer(os.path.join(demo, 'sentencepiece.bpe.model')).vocab_size
    filter_release(tmp_path / 'phase2', vocab=vocab, m=1, k=1, n_layer=2, dim=64, ffn=128, heads=2)  # the tiny preset
    os.makedirs(tmp_path / 'run')
    os.symlink(demo, tmp_path / 'run' / 'demo-data')
    train.main(['--demo', '--method', 'filter', '--task', 'xnli', '--init', str(tmp_path / 'phase2'), '--eval_only',
                '--out', str(tmp_path / 'run')])
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    assert set(results['test']) >= {'en', 'de'} and not os.path.exists(tmp_path / 'run' / 'best.pt')
    paired = os.path.join(demo, 'xnli', 'translate-test', 'test-de-en-translated.tsv')  # a, b, their English, label
    train.main(['--out', str(tmp_path / 'run'), '--predict', paired])
    predicted = open(tmp_path / 'run' / 'predicted' / 'test-de-en-translated.tsv').read().split()
    assert predicted == open(tmp_path / 'run' / 'predictions' / 'xnli' / 'test-de.tsv').read().split()
    assert len(predicted) == len(open(paired).readlines())
    config = json.load(open(tmp_path / 'run' / 'config.json'))
    del config['share_seed']  # a run's config of before the option: its default
    json.dump(config, open(tmp_path / 'run' / 'config.json', 'w'))
    train.main(['--out', str(tmp_path / 'run'), '--predict', paired])
    json.dump({**config, 'eval_only': False}, open(tmp_path / 'run' / 'config.json', 'w'))  # a run that trained
    with pytest.raises(SystemExit, match='keeps no best.pt: predict with the run that trained it'):
        train.main(['--out', str(tmp_path / 'run'), '--predict', paired])


def test_with_filters_data_the_languages_it_left_untranslated_are_not_trained_on(tmp_path, capsys):
    path = data.split_path(str(tmp_path), 'udpos', 'translate-train', 'de')
    os.makedirs(os.path.dirname(path))
    open(path, 'w').write('Haus\n')
    args = argparse.Namespace(translations='filter', data_dir=str(tmp_path), task='udpos', train_lang=None)
    assert xlt.Filter.train_langs(args, ['de', 'eu']) == ['de']
    assert 'translates no udpos training data into eu: filter trains without them' in capsys.readouterr().out
    assert xlt.Filter.train_langs(argparse.Namespace(**{**vars(args), 'translations': 'xtreme'}), ['de', 'eu']) == [
        'de', 'eu']  # XTREME's: every language, each file needed


def test_a_released_models_own_sentencepiece_model_is_the_tokenizer(tmp_path):
    """FILTER's release folders ship sentencepiece.bpe.model beside the weights (tokenizer.save_pretrained): --init
    FOLDER reads it; --spm still wins, and a checkpoint file's run reads the data folder's."""
    folder, data_dir = tmp_path / 'phase2', str(tmp_path / 'data')
    folder.mkdir()
    (folder / 'sentencepiece.bpe.model').write_text('its own')
    assert data.tokenizer_file('xlmr', data_dir, init=str(folder))[0] == str(folder / 'sentencepiece.bpe.model')
    assert data.tokenizer_file('xlmr', data_dir, spm='given.model', init=str(folder))[0] == 'given.model'
    (tmp_path / 'sentencepiece.bpe.model').write_text('not beside a folder')
    assert data.tokenizer_file('xlmr', data_dir, init=str(tmp_path / 'best.pt'))[0] == os.path.join(
        data_dir, 'sentencepiece.bpe.model')


def test_filter_trains_qa_without_chinese(tmp_path):
    """FILTER's run_xqa.py leaves Chinese out of QA's training ("the tokenize issue"); its other tasks keep it."""
    args = lambda task: argparse.Namespace(translations='xtreme', data_dir=str(tmp_path), task=task, train_lang=None)
    assert xlt.Filter.train_langs(args('mlqa'), ['de', 'zh']) == ['de']
    assert xlt.Filter.train_langs(args('xnli'), ['de', 'zh']) == ['de', 'zh']
