"""Stand-ins for a kvwire.Sender, torch and its CUDA events, which record what a KVSender
asks of them: the adapters' ordering after GPU writes (kvwire._order) is tested with
them without a GPU (test_connector_order, test_sglang_backend)."""
import types


class Event:
    """A torch.cuda.Event: `done` is what query() answers; synchronize() is logged."""

    def __init__(self, done=True, log=None):
        self.done, self.log = done, log if log is not None else []
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("synchronize", self))
        self.done = True


class Room:
    """A kvwire.Sender: calls holds (name, begin, end, last) per chunk and
    ("layers_ready", begin, end, event) per mark."""

    def __init__(self):
        self.calls = []

    def send(self, *a):
        self.calls.append(("send",) + a[1:4])

    def send_streamed(self, *a):
        self.calls.append(("send_streamed",) + a[1:4])

    def layers_ready(self, b, e=None, event=None):
        self.calls.append(("layers_ready", b, e, event))

    def set_metadata(self, data):
        self.calls.append(("set_metadata",))


def fake_torch(made, done=True):
    """A torch module whose cuda.Event() appends an Event (query() answering `done`) to
    `made`, and whose current_stream(dev) is ("stream", dev)."""
    mod = types.ModuleType("torch")
    mod.cuda = types.SimpleNamespace(
        Event=lambda: made.append(Event(done=done)) or made[-1],
        current_stream=lambda dev: ("stream", dev))
    return mod
