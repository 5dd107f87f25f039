"""`AfterStepSink` drops, key by key, the steps the wrapped sink already holds."""

from mlm_pipeline.sinks import AfterStepSink


class ListSink:
    def __init__(self):
        self.records = []

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def flush(self):
        pass

    def close(self):
        pass


def test_a_key_held_to_an_earlier_step_still_gets_the_later_ones():
    inner = ListSink()
    sink = AfterStepSink(inner, {"train/loss": 4, "eval/loss": 2})
    for step in range(1, 6):
        record = {"train/loss": float(step)}
        if step % 2 == 0:
            record["eval/loss"] = 10.0 + step
        sink.log(record, step)
    sink.log({"train/new_key": 1.0}, 1)  # a key the sink holds nothing of
    assert inner.records == [(4, {"eval/loss": 14.0}), (5, {"train/loss": 5.0}),
                             (1, {"train/new_key": 1.0})]


def test_one_step_for_every_key():
    inner = ListSink()
    sink = AfterStepSink(inner, 3)
    for step in (2, 3, 4):
        sink.log({"train/loss": 1.0, "eval/loss": 2.0}, step)
    assert inner.records == [(4, {"train/loss": 1.0, "eval/loss": 2.0})]
