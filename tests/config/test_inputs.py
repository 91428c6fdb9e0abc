"""One table of user-facing inputs (config/inputs.py), and a UserError about one of them
rendered in each front end's words (errors.UserError): the CLI's flag, the API's argument
or `cluster=` key, the site file's key."""
from __future__ import annotations

import re

import pytest

from enn_cluster.config.inputs import INPUTS, OTHER_INPUTS
from enn_cluster.config.launch_options import OPTIONS
from enn_cluster.errors import FRONT_ENDS, Said, UserError


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w\[\"-]){re.escape(name)}(?![\w\"-])", text) is not None


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_every_input_renders_in_each_front_end(name):
    """The error's field, a mention of the input and of it with a value, in each front end:
    its own name there, never another front end's (a front end without one: the CLI's)."""
    field = INPUTS[name]
    exc = UserError("{value!r} is wrong", field=field, value="v 1",
                    fix="pass {again} or drop {field}", again=Said(field, "x"))
    cli = str(exc)
    assert cli == exc.rendered("cli")
    assert cli.startswith(f"{field.cli}: 'v 1' is wrong; pass "), cli
    assert cli.endswith(f" or drop {field.cli}"), cli
    api, site = exc.rendered("api"), exc.rendered("site")
    if field.api:
        assert api.startswith(f"{field.api}: 'v 1' is wrong; pass "), api
        assert not _named(api, field.cli), api
    else:
        assert api.startswith(f"{field.cli}: "), api
    if field.site:
        assert site == f"{field.site}: 'v 1' is wrong; pass {field.site}: x or drop {field.site}"
    else:
        assert site == cli
    with pytest.raises(ValueError, match="front end"):
        exc.rendered("gui")


def test_a_value_said_with_its_input_reads_as_each_front_end_writes_it():
    said = {"cli": [], "api": [], "site": []}
    for front in FRONT_ENDS:
        exc = UserError("{a} {b} {c} {d}", a=Said(INPUTS["gpus_per_node"], 0),
                        b=Said(INPUTS["container"], "none"), c=Said(INPUTS["step"], 7),
                        d=Said(INPUTS["set"], "training.lr=1e-4"))
        said[front] = exc.rendered(front)
    assert said["cli"] == "--gpus-per-node 0 --container none --step 7 --set training.lr=1e-4"
    assert said["api"] == ('cluster["gpus_per_node"]=0 cluster["container"]=\'none\' step=7 '
                           "training={'lr': 1e-4}")
    assert said["site"] == "gpus_per_node: 0 image: none --step 7 --set training.lr=1e-4"
    # the CLI quotes a value a shell would split
    assert str(UserError("{a}", a=Said(INPUTS["partition"], "a b"))) == "--partition 'a b'"


def test_the_table_holds_every_launch_option_a_front_end_takes_once():
    assert [i.name for i in OTHER_INPUTS if i.name in {o.name for o in OPTIONS}] == []
    for option in OPTIONS:
        if option.flag:
            row = INPUTS[option.name]
            assert (row.cli, row.site) == (option.flag, option.site)
            assert row.api == (f'cluster["{option.api}"]' if option.api else None)
    assert {i.named("api") for i in OTHER_INPUTS} >= {"X", "step", "run_or_dir", "out"}


def test_a_plain_message_is_one_line_in_every_front_end_and_braces_stay_text():
    plain = UserError("training.lr: {x} is not a number")
    assert all(plain.rendered(front) == "training.lr: {x} is not a number"
               for front in FRONT_ENDS)
    # a user's value with braces and a credential: quoted as it is, then redacted
    exc = UserError.on(INPUTS["out"], "{step} https://u:secret@host/x.npy exists",
                       fix="pass {out}")
    assert str(exc) == "--out: {step} https://***@host/x.npy exists; pass {out}"
    assert exc.rendered("api") == "out: {step} https://***@host/x.npy exists; pass {out}"
    assert "secret" not in repr(exc.args)


def test_the_api_boundary_names_the_argument_its_function_takes():
    """speaks_api: the same error reads `run_dir` from train, `Run.open(path)` from
    Run.open, and the table's `run_or_dir` elsewhere."""
    from enn_cluster.client.api_words import speaks_api

    def refuse():
        raise UserError("{value} is not a run directory", field=INPUTS["run_dir"], value="/x",
                        fix="give one made by {how}", how=Said(INPUTS["run_dir"], "/runs/r"))

    for names, word in (({}, "run_or_dir"), ({"run_dir": "run_dir"}, "run_dir")):
        with pytest.raises(UserError) as caught:
            speaks_api(**names)(refuse)()
        assert str(caught.value) == (f"{word}: /x is not a run directory; give one made by "
                                     f"{word}='/runs/r'")
    with pytest.raises(UserError) as caught:
        refuse()
    assert str(caught.value) == "RUN_DIR: /x is not a run directory; give one made by /runs/r"
