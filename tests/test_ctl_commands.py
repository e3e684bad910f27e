"""skredctl's command table (no broker): every command lavinmqctl has, under its name, with its
flags, and a --help each; the dashboard's paging, sorting, filtering and poll pacing."""

from __future__ import annotations

import contextlib
import io

import pytest

from broker import ctl
from broker.ctl import tui

# lavinmqctl's commands (LavinMQ's src/lavinmqctl/cli.cr) and the flags its create_* take.
LAVINMQCTL = (
    "add_user delete_user change_password list_users set_user_tags set_permissions hash_password "
    "list_vhosts add_vhost delete_vhost set_vhost_limits list_queues create_queue delete_queue purge_queue "
    "pause_queue resume_queue restart_queue list_exchanges create_exchange delete_exchange list_connections "
    "close_connection close_all_connections list_policies set_policy clear_policy list_shovels add_shovel "
    "delete_shovel list_federations add_federation delete_federation export_definitions import_definitions "
    "definitions status cluster_status stop_app start_app"
).split()
FLAGS = {
    "create_queue": "--auto-delete --durable --expires --max-length --message-ttl --delivery-limit "
    "--reject-on-overflow --dead-letter-exchange --dead-letter-routing-key --stream-queue",
    "create_exchange": "--auto-delete --durable --internal --delayed --alternate-exchange --persist-messages "
    "--persist-ms",
    "set_policy": "--priority --apply-to",
    "add_shovel": "--src-uri --dest-uri --src-queue --dest-queue --src-exchange --dest-exchange "
    "--src-exchange-key --dest-exchange-key --src-prefetch-count --src-delete-after "
    "--ack-mode --reconnect-delay",
    "add_federation": "--uri --expires --message-ttl --max-hops --prefetch-count --reconnect-delay "
    "--ack-mode --consumer-tag --exchange --queue",
}


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        ctl.build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("name", LAVINMQCTL)
def test_every_lavinmqctl_command_with_help(name: str) -> None:
    text = _help(name)
    for flag in FLAGS.get(name, "").split():
        assert flag in text, (name, flag)


def test_global_options_of_lavinmqctl() -> None:
    args = ctl.build_parser().parse_args(["--vhost", "v", "-f", "json", "-q", "-s", "-n", "x", "list_queues"])
    assert (args.global_vhost, args.format, args.quiet, args.silent) == ("v", "json", True, True)
    args = ctl.build_parser().parse_args(["-U", "http://127.0.0.1:9", "status"])
    assert args.url == "http://127.0.0.1:9"
    args = ctl.build_parser().parse_args(["--hostname", "::1", "-P", "7", "status"])
    assert ctl.client(args).url == "http://[::1]:7"


def test_hash_password_needs_no_broker(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--url", "http://127.0.0.1:1", "hash_password", "s3cret"]) == 0
    from broker.auth.passwords import check_password

    assert check_password("s3cret", capsys.readouterr().out.strip())


def test_dashboard_state_sorts_filters_and_paces() -> None:
    st = tui.State()
    st.switch([p.title for p in tui.PAGES].index("queues"))
    st.rows = [{"vhost": "/", "name": n, "messages": m} for n, m in (("b", 5), ("a", 10), ("c", 1))]
    st.sort_col = st.current.columns.index("messages")
    assert [r["name"] for r in st.visible()] == ["c", "b", "a"]  # numbers sort as numbers
    st.reverse, st.filter = True, "A"
    assert [r["name"] for r in st.visible()] == ["a"]  # case-insensitive substring
    assert tui.next_wait(2.0, 0.05) == 2.0
    assert tui.next_wait(2.0, 0.5) == pytest.approx(5.0)  # 0.5 s of broker time in 5 s: a tenth
    assert tui.spark([0, 4, 8], 3) == " ▄█"
