"""SacreBLEU as an offline `evaluate` metric: `evaluate.load(<path to this folder>)`.

The Hub-hosted `sacrebleu` script cannot be fetched without network; this one computes the same corpus BLEU
with the installed `sacrebleu` package.
"""

import datasets
import evaluate
import sacrebleu

_FEATURES = [
    datasets.Features(
        {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
    ),
    datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
]


class SacrebleuLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus BLEU (Papineni et al., 2002) as computed by sacrebleu (Post, 2018).",
            citation="@inproceedings{post-2018-call, title={A Call for Clarity in Reporting BLEU Scores}, year={2018}}",
            inputs_description="predictions: list of str; references: list of str or list of list of str.",
            features=_FEATURES,
        )

    def _compute(self, predictions, references, tokenize="13a", lowercase=False):
        references = [[reference] if isinstance(reference, str) else reference for reference in references]
        reference_streams = [list(stream) for stream in zip(*references)]
        result = sacrebleu.corpus_bleu(predictions, reference_streams, tokenize=tokenize, lowercase=lowercase)
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
        }
