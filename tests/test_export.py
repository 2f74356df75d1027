"""python layers.py export: demo runs written as Hugging Face folders load in transformers with its
Auto classes and compute what the project computes (logits, ids, labels); a model no Hugging Face
XLM-R class computes is refused in one line."""
import argparse
import json
import os

import pytest
import sentencepiece as spm
import torch

import data
import layers
import xlt
from conftest import demo_run, quick_pretrained

transformers = pytest.importorskip('transformers')
pytest.importorskip('google.protobuf')  # transformers reads the sentencepiece model through it
pytestmark = pytest.mark.slow  # the runs it exports are trained first
AUTO = {'xnli': 'AutoModelForSequenceClassification', 'panx': 'AutoModelForTokenClassification',
        'mlqa': 'AutoModelForQuestionAnswering'}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """A short zero-shot demo run of each family, on the demo's own sentencepiece model (a unigram model, as XLM-R's)
    -> (their folder, the demo, the model)."""
    root = tmp_path_factory.mktemp('export')
    demo = data.make_demo(str(root / 'demo-data'), n_train=40, n_eval=12)
    for task in AUTO:
        demo_run(root / task, demo, ['--task', task, '--epochs', '1'])
    return root, demo, os.path.join(demo, 'sentencepiece.bpe.model')


def the_projects(run):
    """The run's method from its best.pt, as train.py evaluates it."""
    ckpt = layers.load_checkpoint(str(run / 'best.pt'))
    settings = argparse.Namespace(**ckpt['meta']['settings'])
    method = xlt.Baseline(layers.Encoder(layers.stored_config(ckpt['config'])), settings.task, settings)
    method.load_state_dict(ckpt['method'])
    return method.eval()


def texts(task, example):
    """The texts of an example as a Hugging Face tokenizer is given them."""
    return {'xnli': (example.get('a'), example.get('b')), 'panx': (' '.join(example.get('words', [])), None),
            'mlqa': (example.get('question'), example.get('context'))}[task]


@pytest.mark.parametrize('task', AUTO)
def test_an_exported_run_computes_the_projects_logits_and_ids(runs, task, tmp_path):
    root, demo, unigram = runs
    layers.main(['export', str(root / task), str(tmp_path / 'hf')])
    model, loading = getattr(transformers, AUTO[task]).from_pretrained(tmp_path / 'hf', output_loading_info=True)
    assert not any(loading.values()), loading  # every tensor read, none left new
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
    tok = data.Tokenizer(unigram)
    examples = data.read_split(demo, task, 'dev', 'de') + data.read_split(demo, task, 'dev', 'zh')
    for a, b in (texts(task, ex) for ex in examples):
        assert hf_tok(a, b)['input_ids'] == tok.encode_pair(a, b)
    if task != 'mlqa':
        assert model.config.id2label == dict(enumerate(data.TASKS[task].labels))
    items = data.evaluation_items(data.Tokenization(tok, demo, task, 384 if task == 'mlqa' else 128, cache=False), examples,
                                  None)
    batch = data.collate([items[i] for i in range(len(items))])
    with torch.no_grad():
        ours = the_projects(root / task).predict(batch)
        out = model.eval()(input_ids=batch.ids, attention_mask=batch.mask)
    theirs = torch.stack([out.start_logits, out.end_logits], -1) if task == 'mlqa' else out.logits
    real = batch.mask.bool() if task != 'xnli' else torch.ones(len(ours), dtype=torch.bool)  # QA's padding: -inf in ours
    assert ours.shape == theirs.shape and torch.allclose(ours[real], theirs[real], atol=1e-5)
    if task == 'xnli':  # the pipeline's label is the project's prediction
        pipe = transformers.pipeline('text-classification', model=str(tmp_path / 'hf'), tokenizer=str(tmp_path / 'hf'))
        said = [pipe({'text': ex['a'], 'text_pair': ex['b']})['label'] for ex in examples]
        assert said == [data.TASKS[task].labels[i] for i in ours.argmax(-1).tolist()]
    labels = data.TASKS[task].labels
    if task != 'mlqa':  # the same model saved with its classes in another order (id2label says which)
        last = model.classifier.out_proj if task == 'xnli' else model.classifier
        order = [2, 0, 1] if task == 'xnli' else list(reversed(range(len(labels))))
        last.weight.data, last.bias.data = last.weight.data[order], last.bias.data[order]
        model.config.id2label = {i: labels[j] for i, j in enumerate(order)}
        model.config.label2id = {labels[j]: i for i, j in enumerate(order)}
    model.save_pretrained(tmp_path / 'saved')
    enc, _ = layers.load_pretrained(str(tmp_path / 'saved'))[:2]  # --init's read: the encoder and the task head
    with torch.no_grad():
        again = xlt.Baseline(enc, task).eval().predict(batch)
    assert torch.allclose(again[real], ours[real], atol=1e-5)
    if task == 'xnli':  # --eval_only from it: the run's own scores
        demo_run(tmp_path / 'again', demo, ['--task', task, '--eval_only', '--init', str(tmp_path / 'saved')])
        scores = lambda run: json.load(open(run / 'results.json'))['test_metrics']
        assert scores(tmp_path / 'again') == scores(root / task)
        model.config.id2label = {i: f'LABEL_{i}' for i in range(3)}
        model.save_pretrained(tmp_path / 'unlabelled')
        with pytest.raises(SystemExit, match='error: --init predicts LABEL_0, LABEL_1, LABEL_2 \\(its id2label\\), '
                                             'not the task.s contradiction, entailment, neutral: give a model'):
            demo_run(tmp_path / 'unlabelled-run', demo, ['--task', task, '--init', str(tmp_path / 'unlabelled')])


def test_the_encoder_alone_and_veco_pretrainings_masked_lm(runs, tmp_path):
    root, demo, unigram = runs
    pre = quick_pretrained(demo, tmp_path / 'pre', steps=4)
    layers.main(['export', pre, str(tmp_path / 'mlm')])
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / 'mlm').eval()
    enc, mlm = layers.load_pretrained(pre)[:2]  # the encoder without its cross-attention, as VECO's NLU model
    ids = torch.tensor([[0, 40, 7, 93, 2, 1], [0, 11, 2, 1, 1, 1]])
    with torch.no_grad():
        ours, theirs = mlm(enc.eval()(ids)), model(input_ids=ids, attention_mask=ids.ne(1)).logits
    assert torch.allclose(ours[ids.ne(1)], theirs[ids.ne(1)], atol=1e-5)
    layers.main(['export', str(root / 'xnli'), str(tmp_path / 'encoder'), '--encoder'])
    model = transformers.AutoModel.from_pretrained(tmp_path / 'encoder').eval()
    with torch.no_grad():
        ours, theirs = the_projects(root / 'xnli').encoder(ids), model(input_ids=ids, attention_mask=ids.ne(1)).last_hidden_state
    assert torch.allclose(ours[ids.ne(1)], theirs[ids.ne(1)], atol=1e-5)


def refused(argv, message):
    with pytest.raises(SystemExit) as err:
        layers.main(['export', *map(str, argv)])
    assert str(err.value).startswith('error: ') and '\n' not in str(err.value) and message in str(err.value), err.value


def test_what_is_not_one_text_through_xlmr_is_refused_in_one_line(runs, tmp_path, monkeypatch):
    root, demo, unigram = runs
    ckpt = layers.load_checkpoint(str(root / 'xnli' / 'best.pt'))
    for method in (xlt.Filter, xlt.XMixup, xlt.VecoTranslate):
        layers.save_checkpoint(str(tmp_path / 'best.pt'), {**ckpt['meta'], 'export': method.EXPORT},
                               **{k: v for k, v in ckpt.items() if k not in ('format', 'meta')})
        refused([tmp_path / 'best.pt', tmp_path / 'out'], f'{method.EXPORT}, which no Hugging Face XLM-R class computes: '
                'export its encoder alone with --encoder')
    os.makedirs(tmp_path / 'xla' / 'epoch1' / 'model1-by23')
    os.symlink(root / 'xnli' / 'best.pt', tmp_path / 'xla' / 'epoch1' / 'model1-by23' / 'best.pt')
    refused([tmp_path / 'xla', tmp_path / 'out'], 'keeps no best.pt: its prediction comes from the models below it '
            '(epoch1/model1-by23/best.pt): export one of them')
    refused([root / 'xnli', root / 'panx'], 'exists and is not an empty folder: give a new folder')
    refused([root / 'xnli', tmp_path / 'out', '--spm', tmp_path / 'none.model'], 'none.model not found: pass --spm')
    spm.SentencePieceTrainer.train(sentence_iterator=iter(data.read_lines(os.path.join(demo, 'xnli', 'test-en.tsv'))),
                                   model_prefix=str(tmp_path / 'bpe'), vocab_size=200, model_type='bpe',
                                   hard_vocab_limit=False, minloglevel=2, num_threads=1)
    refused([root / 'xnli', tmp_path / 'out', '--spm', tmp_path / 'bpe.model'], 'is a BPE sentencepiece '
            'model, which transformers\' XLMRobertaTokenizer would read as a unigram one (XLM-R\'s is)')
    layers.save_checkpoint(str(tmp_path / 'dict.pt'), {**ckpt['meta'], 'tokenizer': [unigram, str(tmp_path / 'dict.txt')]},
                           **{k: v for k, v in ckpt.items() if k not in ('format', 'meta')})
    refused([tmp_path / 'dict.pt', tmp_path / 'out', '--spm', unigram], 'its ids follow a fairseq dict.txt')  # --spm or not
    assert not os.path.exists(tmp_path / 'out')
    monkeypatch.setattr(layers, 'write_safetensors', lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # interrupted halfway: nothing is left behind
        layers.export(str(root / 'xnli'), str(tmp_path / 'cut'))
    assert not [name for name in os.listdir(tmp_path) if name.startswith('cut')]


@pytest.fixture(scope='module')
def bert_runs(tmp_path_factory):
    """A short zero-shot demo run of each family on the tiny BERT -> (their folder, the demo)."""
    root = tmp_path_factory.mktemp('export-bert')
    demo = data.make_demo(str(root / 'demo-data'), n_train=40, n_eval=12)
    for task in AUTO:
        demo_run(root / task, demo, ['--task', task, '--epochs', '1', '--model', 'tiny-bert'])
    return root, demo


@pytest.mark.parametrize('task', AUTO)
def test_an_exported_bert_run_computes_the_projects_logits_and_ids(bert_runs, task, tmp_path):
    """BertFor* and BertTokenizer from the exported folder alone: the run's ids, token types as BertTokenizer
    gives them (segment B after the first [SEP], written out here for QA's windows), the run's logits."""
    root, demo = bert_runs
    layers.main(['export', str(root / task), str(tmp_path / 'hf')])
    model, loading = getattr(transformers, AUTO[task]).from_pretrained(tmp_path / 'hf', output_loading_info=True)
    assert not any(loading.values()), loading
    hf_tok, tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf'), data.WordPiece(demo + '/vocab.txt')
    examples = data.read_split(demo, task, 'dev', 'de') + data.read_split(demo, task, 'dev', 'zh')
    for a, b in (texts(task, ex) for ex in examples):
        assert hf_tok(a, b)['input_ids'] == tok.encode_pair(a, b)
    items = data.evaluation_items(data.Tokenization(tok, demo, task, 384 if task == 'mlqa' else 128, cache=False), examples,
                                  None)
    batch = data.collate([items[i] for i in range(len(items))], pad_id=tok.pad)
    sep = batch.ids.eq(tok.eos).long()
    types = (sep.cumsum(1) - sep).clamp(max=1) * batch.mask
    with torch.no_grad():
        ours = the_projects(root / task).predict(batch)
        out = model.eval()(input_ids=batch.ids, attention_mask=batch.mask.long(), token_type_ids=types)
    theirs = torch.stack([out.start_logits, out.end_logits], -1) if task == 'mlqa' else out.logits
    real = batch.mask.bool() if task != 'xnli' else torch.ones(len(ours), dtype=torch.bool)
    assert ours.shape == theirs.shape and torch.allclose(ours[real], theirs[real], atol=1e-5)
    if task == 'xnli':
        a, b = texts(task, examples[0])  # BertTokenizer's segment B: the second text and its [SEP]
        assert hf_tok(a, b)['token_type_ids'] == types[0, :len(tok.encode_pair(a, b))].tolist()
        pipe = transformers.pipeline('text-classification', model=str(tmp_path / 'hf'), tokenizer=str(tmp_path / 'hf'))
        said = [pipe({'text': ex['a'], 'text_pair': ex['b']})['label'] for ex in examples]
        assert said == [data.TASKS[task].labels[i] for i in ours.argmax(-1).tolist()]
        layers.main(['export', str(root / task), str(tmp_path / 'encoder'), '--encoder'])
        model = transformers.AutoModel.from_pretrained(tmp_path / 'encoder').eval()
        with torch.no_grad():
            theirs = model(input_ids=batch.ids, attention_mask=batch.mask.long(), token_type_ids=types)
            method = the_projects(root / task)
            h = method.encoder(batch.ids)
        assert torch.allclose(h[batch.mask], theirs.last_hidden_state[batch.mask], atol=1e-5)
        assert torch.allclose(torch.tanh(method.encoder.pooler(h[:, 0])), theirs.pooler_output, atol=1e-5)
