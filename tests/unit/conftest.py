"""Session-wide fixtures of the weights reader's tests (test_weights_reader.py, test_weights_boxes.py): the
sources are written once for both files (the DCP directories by two forked gloo ranks)."""
import pytest

from weights_sources import write_dcp_dirs, write_sources


@pytest.fixture(scope="session")
def dcp_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    write_dcp_dirs(out)
    return out


@pytest.fixture(scope="session")
def sources(tmp_path_factory, dcp_dirs):
    """kind -> (path, the state the path holds)."""
    return write_sources(tmp_path_factory.mktemp("weights"), dcp_dirs)
