"""Images across processes: a request's images reach the engine core, and a
sequence's the parallel workers, as the same ``ProcessedImage`` (bit for bit);
the core's limits tell the API process whether the model takes images."""

from __future__ import annotations

import torch

from engine.api import core_protocol
from engine.api.request import ImageInput, Request
from engine.api.request_limits import RequestLimits
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage
from engine.parallel import worker_protocol as wire


def _image(seed: int) -> ImageInput:
    plan = ImagePlan(100, 30, 126, 42, 14, 3, squeeze=True)
    patches = torch.randn(plan.n_patches, 588, generator=torch.Generator().manual_seed(seed))
    return ImageInput(5 + seed, ProcessedImage(plan, patches, bytes(range(seed, seed + 32))))


def _same(a: ImageInput, b: ImageInput) -> None:
    assert (a.offset, a.image.plan, a.image.content_hash) == (
        b.offset,
        b.image.plan,
        b.image.content_hash,
    )
    assert a.image.patches.dtype == torch.float32
    assert torch.equal(a.image.patches, b.image.patches)


def test_a_requests_images_reach_the_core() -> None:
    images = [_image(0), _image(40)]
    request = Request("r", list(range(80)), images=images)
    data = core_protocol.ENCODER.encode(core_protocol.add_msg(request))
    back = core_protocol.request_of(core_protocol.TO_CORE.decode(data))
    assert len(back.images) == 2
    for a, b in zip(back.images, images, strict=True):
        _same(a, b)
    text = core_protocol.request_of(
        core_protocol.TO_CORE.decode(
            core_protocol.ENCODER.encode(core_protocol.add_msg(Request("t", [1, 2])))
        )
    )
    assert text.images == []


def test_a_sequences_images_reach_the_workers() -> None:
    from engine.api.image_wire import image_of, wire_image

    item = _image(3)
    state = wire.SeqState(1, 0, [1, 2], 2, [0], 0, [0], False, None, False, [wire_image(item)])
    work = wire.StepWork(1, [], [state], [], [(1, 0, 2, True)], True)
    (back,) = wire.TO_WORKER.decode(wire.ENCODER.encode(work)).seqs
    _same(image_of(back.images[0]), item)


def test_limits_say_whether_the_model_takes_images() -> None:
    import msgspec

    limits = RequestLimits(
        100, 1000, 8, 10, False, image_token_id=7, image_patch_size=14, image_downsample_ratio=3
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(limits), type=RequestLimits)
    assert back == limits and back.takes_images
    assert not RequestLimits(100, 1000, 8, 10, False).takes_images
