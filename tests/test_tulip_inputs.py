"""Request validation: every invalid-input class is rejected with a message naming it."""

from __future__ import annotations

import numpy as np
import pytest

from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import pack_token_batch
from tulip.errors import InvalidInput
from tulip.inputs import ModelLimits, embed_work, score_work

EMBEDDER = ModelLimits(
    kind="embedding", vocab_size=1000, max_input_tokens=8, dimensions=16, default_normalize=True
)
RERANKER = ModelLimits(
    kind="cross-encoder", vocab_size=1000, max_input_tokens=8, dimensions=0, default_normalize=False
)


def embed(rows: list[list[int]], **fields: int) -> pb.EmbedRequest:
    request = pb.EmbedRequest(inputs=pack_token_batch(rows))
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_valid_embed_request_keeps_inputs_together() -> None:
    request = embed([[0, 5, 2], [0, 999, 7, 2]], pooling=pb.POOLING_CLS, dimensions=8)
    work, options = embed_work(request, EMBEDDER)
    assert work.ids.tolist() == [0, 5, 2, 0, 999, 7, 2]
    assert work.lengths.tolist() == [3, 4]
    assert (work.rows, work.tokens) == (2, 7)
    assert work.pooling == "cls" and work.normalize is None
    assert options.dimensions == 8 and options.normalize is True
    _, defaults = embed_work(embed([[1]], normalize=pb.NORMALIZE_OFF), EMBEDDER)
    assert defaults.dimensions == 16 and defaults.normalize is False


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (embed([]), r"inputs: no inputs"),
        (embed([[1, 2], []]), r"inputs\[1\]: empty sequence"),
        (embed([[1], [2], [3, 1000]]), r"inputs\[2\]: token id 1000 at position 1 is outside"),
        (embed([[1] * 9]), r"inputs\[0\]: 9 tokens is longer than the model's maximum of 8"),
        (
            pb.EmbedRequest(inputs=pb.TokenBatch(ids=b"\x01\x00\x00\x00" * 3, lengths=[2])),
            r"inputs: lengths sum to 2 but ids holds 3 tokens",
        ),
        (
            pb.EmbedRequest(inputs=pb.TokenBatch(ids=b"\x01\x00\x00", lengths=[1])),
            r"inputs: ids holds 3 bytes",
        ),
        (embed([[1]], dimensions=17), r"dimensions: 17 is more than the model's 16"),
        (embed([[1]], pooling=9), r"pooling: unknown value 9"),
        (embed([[1]], dtype=7), r"dtype: unknown value 7"),
    ],
)
def test_invalid_embed_inputs_are_named(request_: pb.EmbedRequest, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        embed_work(request_, EMBEDDER)


def spans(rows: list[list[int]], counts: list[int], bounds: list[int]) -> pb.EmbedRequest:
    request = embed(rows)
    request.span_counts.extend(counts)
    request.spans.extend(bounds)
    return request


def test_spans_give_one_result_row_each() -> None:
    work, _ = embed_work(spans([[0, 5, 6, 2], [7]], [2, 1], [1, 2, 2, 3, 0, 1]), EMBEDDER)
    assert work.span_counts is not None and work.spans is not None
    assert work.span_counts.tolist() == [2, 1]
    assert work.spans.tolist() == [[1, 2], [2, 3], [0, 1]]
    assert (work.rows, work.outputs) == (2, 3)
    plain, _ = embed_work(embed([[1], [2]]), EMBEDDER)
    assert plain.span_counts is None and plain.outputs == 2


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (spans([[1, 2]], [1, 1], [0, 1, 1, 2]), r"span_counts: 2 counts for 1 inputs"),
        (spans([[1, 2], [3]], [1, 0], [0, 1]), r"span_counts\[1\]: 0 spans"),
        (spans([[1, 2]], [2], [0, 1]), r"spans: 2 values for 2 spans"),
        (spans([[1, 2]], [1], [1, 1]), r"spans\[0\]: \[1, 1\) is not a non-empty span"),
        (spans([[1, 2], [3]], [1, 1], [0, 2, 0, 2]), r"spans\[1\]: \[0, 2\) .* \(1 tokens\)"),
    ],
)
def test_invalid_spans_are_named(request_: pb.EmbedRequest, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        embed_work(request_, EMBEDDER)


def test_wrong_rpc_for_the_model_kind() -> None:
    with pytest.raises(InvalidInput, match="Embed needs an embedding model"):
        embed_work(embed([[1]]), RERANKER)
    with pytest.raises(InvalidInput, match="Score needs a cross-encoder"):
        score_work(pb.ScoreRequest(pairs=pack_token_batch([[1]])), EMBEDDER)


def test_score_pairs_and_segments() -> None:
    request = pb.ScoreRequest(
        pairs=pack_token_batch([[0, 4, 2, 2, 9, 2], [0, 5, 2]]), first_segment_lengths=[3, 3]
    )
    work, activation = score_work(request, RERANKER)
    assert work.first_segment_lengths is not None
    assert work.first_segment_lengths.tolist() == [3, 3] and activation == "default"
    assert (
        score_work(pb.ScoreRequest(pairs=pack_token_batch([[1]])), RERANKER)[
            0
        ].first_segment_lengths
        is None
    )
    bad_count = pb.ScoreRequest(pairs=pack_token_batch([[1], [2]]), first_segment_lengths=[1])
    with pytest.raises(InvalidInput, match="first_segment_lengths: 1 values for 2 pairs"):
        score_work(bad_count, RERANKER)
    too_long = pb.ScoreRequest(pairs=pack_token_batch([[1], [2, 3]]), first_segment_lengths=[1, 3])
    with pytest.raises(InvalidInput, match=r"pairs\[1\]: first segment of 3 tokens"):
        score_work(too_long, RERANKER)
    with pytest.raises(InvalidInput, match=r"pairs\[0\]: token id 1000"):
        score_work(pb.ScoreRequest(pairs=pack_token_batch([[1000]])), RERANKER)


def test_vocabulary_check_is_exact_at_the_boundary() -> None:
    work, _ = embed_work(embed([[999]]), EMBEDDER)
    assert work.ids.dtype == np.uint32
    with pytest.raises(InvalidInput, match="token id 1000"):
        embed_work(embed([[1000]]), EMBEDDER)


def test_segments_are_dropped_for_models_with_one_token_type() -> None:
    one_type = ModelLimits(
        kind="cross-encoder",
        vocab_size=1000,
        max_input_tokens=8,
        dimensions=0,
        default_normalize=False,
        token_types=1,
    )
    request = pb.ScoreRequest(pairs=pack_token_batch([[0, 4, 2, 9]]), first_segment_lengths=[3])
    assert score_work(request, one_type)[0].first_segment_lengths is None
    # ... but a malformed value is still an error.
    bad = pb.ScoreRequest(pairs=pack_token_batch([[0, 4]]), first_segment_lengths=[3])
    with pytest.raises(InvalidInput, match=r"pairs\[0\]: first segment"):
        score_work(bad, one_type)


BGE_M3 = ModelLimits(
    kind="embedding",
    vocab_size=1000,
    max_input_tokens=8,
    dimensions=16,
    default_normalize=True,
    outputs=frozenset({"dense", "sparse", "multi_vector", "token_states"}),
)


def with_outputs(rows: list[list[int]], outputs: list[int]) -> pb.EmbedRequest:
    request = embed(rows)
    request.outputs.extend(outputs)
    return request


def test_output_kinds_travel_with_the_work() -> None:
    request = with_outputs([[0, 5, 2]], [pb.OUTPUT_SPARSE, pb.OUTPUT_MULTI_VECTOR])
    work, options = embed_work(request, BGE_M3)
    assert work.kinds == {"sparse", "multi_vector"}
    assert options.outputs == {"sparse", "multi_vector"}  # no dense: not asked for
    plain, defaults = embed_work(embed([[1]]), BGE_M3)
    assert plain.kinds is None and defaults.outputs == {"dense"}
    dense, _ = embed_work(with_outputs([[1]], [pb.OUTPUT_DENSE]), EMBEDDER)
    assert dense.kinds is None


@pytest.mark.parametrize(
    ("limits", "request_", "message"),
    [
        (EMBEDDER, with_outputs([[1]], [pb.OUTPUT_SPARSE]), r"outputs\[0\]: .* cannot give sparse"),
        (BGE_M3, with_outputs([[1]], [pb.OUTPUT_DENSE, pb.OUTPUT_DENSE]), r"outputs\[1\]: dense"),
        (BGE_M3, with_outputs([[1]], [9]), r"outputs\[0\]: unknown value 9"),
    ],
)
def test_invalid_outputs_are_named(
    limits: ModelLimits, request_: pb.EmbedRequest, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        embed_work(request_, limits)


def test_outputs_beyond_dense_do_not_combine_with_spans() -> None:
    request = spans([[0, 5, 6, 2]], [1], [1, 3])
    request.outputs.append(pb.OUTPUT_TOKEN_STATES)
    with pytest.raises(InvalidInput, match="token_states do not combine with spans"):
        embed_work(request, BGE_M3)
