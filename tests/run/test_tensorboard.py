"""The hand-written TensorBoard writer produces files TensorBoard itself reads."""
import pytest

from jaxrl.tensorboard import ScalarWriter, crc32c


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_tensorboard_reads_the_scalars(tmp_path):
    loader_mod = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    writer = ScalarWriter(tmp_path)
    writer.write(1, {"reward/mean": 0.25, "loss/kl": 0.5})
    writer.write(2, {"reward/mean": 0.75})
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = list(loader_mod.LegacyEventFileLoader(str(path)).Load())
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert events[0].file_version == "brain.Event:2"
    assert scalars == [(1, "reward/mean", 0.25), (1, "loss/kl", 0.5), (2, "reward/mean", 0.75)]
