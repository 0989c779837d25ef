"""Malformed specs → the first diagnostic's code, exact 1-based line:col, and a helpful message.

Each row is (file in tests/bad_specs/, code, line, col, substrings the message must contain).
The position is where the offending key or value starts (checked by hand); for a missing field it
is the nearest mapping that exists, for end-of-input errors the end of the file. New cases are new
rows (STYLE: fixture-driven tests).
"""

from __future__ import annotations

import pathlib

import pytest

import geomopt
from geomopt.spec.diagnostics import LANGUAGE_CODES
from geomopt.spec.source import MAX_BYTES

HERE = pathlib.Path(__file__).parent / "bad_specs"
ALL_ROLES = "(roles: embedding, head, router, expert, norm, bias, hidden, other)"

CASES = [
    # ---------------------------------------------------------------- unknown kinds (GO004)
    ("yaml_unknown_geometry_kind.yaml", "GO004", 6, 22, ["did you mean 'spectral'", "expected one of: euclidean"]),
    ("yaml_unknown_constraint_kind.yaml", "GO004", 9, 24, ["did you mean 'frobenius_ball'", "stiefel"]),
    ("yaml_unknown_reference_kind.yaml", "GO004", 8, 25, ["did you mean 'log_barrier'", "indicator"]),
    ("yaml_unknown_approx_kind.yaml", "GO004", 9, 22, ["did you mean 'newton_schulz'", "polar_express"]),
    ("yaml_unknown_direction_kind.yaml", "GO004", 5, 21, ["direction kind 'polyk'", "did you mean 'polyak'"]),
    ("yaml_unknown_schedule_kind.yaml", "GO004", 10, 13, ["schedule kind 'theroy'", "did you mean 'theory'"]),
    ("yaml_unknown_prenormalize_kind.yaml", "GO004", 9, 28, ["did you mean 'frobenius'"]),
    ("dsl_unknown_geometry_kind.geom", "GO004", 4, 14, ["did you mean 'spectral'"]),
    ("dsl_unknown_constraint_kind.geom", "GO004", 5, 16, ["did you mean 'frobenius_ball'"]),
    ("dsl_unknown_reference_kind.geom", "GO004", 4, 23, ["reference kind 'indicatr'", "did you mean 'indicator'"]),
    ("dsl_unknown_approx_kind.geom", "GO004", 4, 41, ["did you mean 'newton_schulz'"]),
    ("dsl_unknown_direction_kind.geom", "GO004", 3, 28, ["did you mean 'polyak'"]),
    ("dsl_unknown_schedule_kind.geom", "GO004", 5, 14, ["did you mean 'theory'"]),
    ("yaml_view_unknown_kind.yaml", "GO004", 9, 13, ["view kind 'atuo'", "did you mean 'auto'", "auto, matrix"]),
    ("dsl_view_unknown_kind.geom", "GO004", 4, 39, ["view kind 'atuo'", "did you mean 'auto'"]),
    ("yaml_kind_missing.yaml", "GO006", 6, 15, ["geometry needs a 'kind'"]),
    # ---------------------------------------------------------------- misspelled fields (GO003)
    ("yaml_misspelled_top_field.yaml", "GO003", 3, 1, ["'descripton'", "did you mean 'description'"]),
    ("yaml_misspelled_defaults_field.yaml", "GO003", 5, 3, ["did you mean 'weight_decay'", "defaults fields:"]),
    ("yaml_misspelled_rule_field.yaml", "GO003", 6, 5, ["did you mean 'geometry'"]),
    ("yaml_misspelled_match_field.yaml", "GO003", 5, 13, ["did you mean 'name'", "module, name, ndim, role, shape"]),
    ("yaml_misspelled_reference_field.yaml", "GO003", 8, 40, ["did you mean 'kappa'", "eps, kappa, kind"]),
    ("yaml_misspelled_constraint_field.yaml", "GO003", 9, 33, ["did you mean 'radius'"]),
    ("yaml_field_of_other_kind.yaml", "GO003", 6, 33, ["unknown field 'reference'", "kind, radius"]),
    ("yaml_view_on_isotropic.yaml", "GO003", 6, 63, ["unknown field 'view'", "kind, radius, reference, scale"]),
    ("dsl_misspelled_call_field.geom", "GO003", 4, 37, ["did you mean 'kappa'"]),
    ("dsl_misspelled_match_field.geom", "GO003", 3, 19, ["did you mean 'name'"]),
    ("dsl_misspelled_keyword.geom", "GO001", 4, 5, ["'geometyr'", "did you mean 'geometry'"]),
    ("dsl_misspelled_setting.geom", "GO001", 3, 10, ["'lrr'", "did you mean 'lr'"]),
    ("dsl_misspelled_statement.geom", "GO001", 3, 1, ["'rules'", "did you mean 'rule'"]),
    # ---------------------------------------------------------------- wrong types and ranges (GO005)
    ("yaml_lr_yes.yaml", "GO005", 9, 9, ["rules[0].lr", "valid number", "got 'yes'"]),
    ("yaml_lr_on.yaml", "GO005", 4, 7, ["defaults.lr", "got 'on'"]),
    ("yaml_lr_quoted_number.yaml", "GO005", 9, 9, ["got '0.02'"]),
    ("yaml_lr_sexagesimal.yaml", "GO005", 9, 9, ["got '10:30'"]),
    ("yaml_lr_bool.yaml", "GO005", 9, 9, ["valid number", "got true"]),
    ("yaml_bool_as_number.yaml", "GO005", 4, 51, ["nesterov", "expected true or false", "got 1"]),
    ("yaml_dion_rank_fraction_above_one.yaml", "GO005", 7, 35,
     ["direction.rank", "an int ≥ 1 or a fraction of min(m, n) in (0, 1]", "got 1.5"]),
    ("dsl_dion_rank_zero.geom", "GO005", 5, 25, ["direction.rank", "an int ≥ 1", "got 0"]),
    ("yaml_bool_as_word.yaml", "GO005", 9, 22, ["expected true or false", "got 'yes'"]),
    ("yaml_int_as_bool.yaml", "GO005", 9, 33, ["valid integer", "got true"]),
    ("yaml_int_as_float.yaml", "GO005", 9, 31, ["valid integer", "got 2.5"]),
    ("yaml_negative_radius.yaml", "GO005", 9, 48, ["constraint.radius", "greater than 0", "-0.5"]),
    ("yaml_zero_radius.yaml", "GO005", 8, 15, ["geometry.radius", "greater than 0"]),
    ("yaml_infinite_radius.yaml", "GO005", 9, 47, ["finite number"]),
    ("yaml_k_zero.yaml", "GO005", 9, 31, ["constraint.k", "greater than or equal to 1"]),
    ("yaml_kappa_half.yaml", "GO005", 8, 47, ["kappa", "greater than or equal to 1", "0.5"]),
    ("yaml_steps_zero.yaml", "GO005", 9, 44, ["approx.steps", "greater than or equal to 1"]),
    ("yaml_coefficients_pairs.yaml", "GO005", 11, 51, ["coefficients[1]", "at least 3 items"]),
    ("yaml_coefficients_flat.yaml", "GO005", 9, 52, ["coefficients[0]", "valid list"]),
    ("yaml_coefficients_count.yaml", "GO005", 12, 23, ["1 or steps=3 triples, got 2"]),
    ("yaml_unknown_coefficient_set.yaml", "GO005", 9, 61, ["'cans' or 'aol'", "did you mean 'aol'"]),
    ("yaml_aol_with_svd.yaml", "GO005", 10, 21, ["aol with approx gram_eigh", "use it with a polynomial approx"]),
    ("yaml_literal_typo.yaml", "GO005", 9, 14, ["got 'scoin'", "did you mean 'scion'"]),
    ("yaml_betas_length.yaml", "GO005", 6, 35, ["betas", "at least 2 items"]),
    ("yaml_geometry_scalar.yaml", "GO005", 6, 15, ["rules[0].geometry", "got 'spectral'"]),
    ("yaml_rules_mapping.yaml", "GO005", 4, 3, ["rules", "valid list"]),
    ("yaml_bad_rule_name.yaml", "GO005", 4, 11, ["rules[0].name", "'hidden layers'"]),
    ("yaml_match_no_predicate.yaml", "GO005", 5, 12, ["at least one of name, module, role, ndim, shape"]),
    ("yaml_empty_rules.yaml", "GO005", 3, 8, ["rules", "at least 1 item"]),
    ("dsl_lr_yes.geom", "GO005", 5, 8, ["rules[0].lr", "got 'yes'"]),
    ("dsl_lr_string.geom", "GO005", 5, 8, ["got '0.02'"]),
    ("dsl_bool_as_number.geom", "GO005", 3, 47, ["expected true or false", "got 1"]),
    ("dsl_negative_radius.geom", "GO005", 5, 38, ["greater than 0", "-0.5"]),
    ("dsl_zero_radius.geom", "GO005", 4, 41, ["greater than 0"]),
    ("dsl_k_zero.geom", "GO005", 5, 23, ["constraint.k"]),
    ("dsl_kappa_half.geom", "GO005", 4, 43, ["kappa"]),
    ("dsl_steps_zero.geom", "GO005", 4, 61, ["steps"]),
    ("dsl_coefficients_pairs.geom", "GO005", 5, 64, ["coefficients[1]", "at least 3 items"]),
    ("dsl_literal_typo.geom", "GO005", 4, 41, ["did you mean 'out_in'"]),
    # ---------------------------------------------------------------- roles and views (GO005)
    ("yaml_unknown_role.yaml", "GO005", 5, 19, ["rules[0].match.role", "unknown role 'hedd'", "did you mean 'head'", ALL_ROLES]),
    ("yaml_unknown_role_in_list.yaml", "GO005", 5, 28, ["match.role[1]", "unknown role 'exprt'", "did you mean 'expert'", ALL_ROLES]),
    ("yaml_unknown_roles_key.yaml", "GO005", 5, 3, ["roles: unknown role 'routr'", "did you mean 'router'", ALL_ROLES]),
    ("yaml_view_blocks_zero.yaml", "GO005", 9, 46, ["view.blocks", "greater than or equal to 1", "got 0"]),
    ("yaml_view_blocks_empty.yaml", "GO005", 9, 36, ["view.blocks", "at least 1 item"]),
    ("dsl_unknown_role.geom", "GO005", 3, 33, ["match.role[1]", "unknown role 'exprt'", "did you mean 'expert'", ALL_ROLES]),
    ("dsl_unknown_roles_key.geom", "GO005", 3, 26, ["roles: unknown role 'routr'", "did you mean 'router'", ALL_ROLES]),
    ("dsl_view_blocks_zero.geom", "GO005", 4, 62, ["view.blocks", "greater than or equal to 1", "got 0"]),
    ("dsl_view_trailing_typo.geom", "GO005", 4, 55, ["view.trailing", "got 'col'", "did you mean 'cols'"]),
    # ---------------------------------------------------------------- duplicates (GO002; rule names GO005)
    ("yaml_duplicate_key.yaml", "GO002", 10, 5, ["duplicate key 'lr'", "line 9, column 5"]),
    ("yaml_duplicate_nested_key.yaml", "GO002", 9, 7, ["duplicate key 'kind'", "line 7, column 7"]),
    ("yaml_duplicate_rule_name.yaml", "GO005", 9, 11, ["duplicate rule name 'hidden'", "line 4, column 11"]),
    ("dsl_duplicate_key.geom", "GO002", 6, 5, ["duplicate key 'lr'", "line 5, column 5"]),
    ("dsl_duplicate_call_key.geom", "GO002", 4, 46, ["duplicate key 'radius'", "line 4, column 34"]),
    ("dsl_duplicate_geometry.geom", "GO002", 5, 5, ["duplicate key 'geometry'"]),
    ("dsl_duplicate_name_statement.geom", "GO002", 3, 1, ["duplicate key 'name'", "line 2, column 1"]),
    ("dsl_duplicate_match_pattern.geom", "GO002", 3, 31, ["duplicate key 'name'"]),
    ("dsl_duplicate_rule_name.geom", "GO005", 5, 6, ["duplicate rule name 'hidden'", "line 3, column 6"]),
    ("dsl_duplicate_roles_statement.geom", "GO002", 4, 1, ["duplicate key 'roles'", "line 3, column 1"]),
    # ---------------------------------------------------------------- patterns (GO007)
    ("yaml_bad_regex.yaml", "GO007", 5, 12, ["bad regular expression 'a(('"]),
    ("yaml_bad_regex_in_mapping.yaml", "GO007", 5, 28, ["bad regular expression '[a-'"]),
    ("yaml_empty_match.yaml", "GO007", 5, 12, ["empty name pattern", "'**'"]),
    ("dsl_bad_regex.geom", "GO007", 3, 19, ["bad regular expression"]),
    ("dsl_empty_match.geom", "GO007", 3, 19, ["empty name pattern"]),
    ("yaml_roles_bad_regex.yaml", "GO007", 4, 23, ["roles: bad regular expression 'proj(('"]),
    ("dsl_roles_bad_regex.geom", "GO007", 3, 26, ["roles: bad regular expression 'proj(('"]),
    # ---------------------------------------------------------------- syntax (GO001)
    ("yaml_unterminated_string.yaml", "GO001", 2, 7, ["unterminated quoted string"]),
    ("yaml_unterminated_flow.yaml", "GO001", 6, 15, ["never closed"]),
    ("yaml_tab_indent.yaml", "GO001", 5, 1, ["spaces, not tabs"]),
    ("yaml_multi_document.yaml", "GO001", 9, 1, ["single document"]),
    ("dsl_unterminated_string.geom", "GO001", 3, 19, ["unterminated string"]),
    ("dsl_bad_escape.geom", "GO001", 3, 19, ["bad string literal", "JSON escapes"]),
    ("dsl_lone_surrogate.geom", "GO001", 2, 6, ["lone surrogate"]),
    ("dsl_missing_colon.geom", "GO001", 4, 5, ["expected ':' before 'geometry'"]),
    ("dsl_missing_match.geom", "GO001", 3, 12, ["unexpected token ':'", "expected one of match"]),
    ("dsl_missing_pattern.geom", "GO001", 3, 18, ["a name, a string"]),
    ("dsl_garbage_character.geom", "GO001", 4, 34, ["unexpected character '@'"]),
    ("dsl_garbage_semicolon.geom", "GO001", 4, 33, ["unexpected character ';'"]),
    ("dsl_unclosed_call.geom", "GO001", 5, 1, ["end of input", "')'"]),
    ("dsl_missing_value.geom", "GO001", 5, 1, ["end of input", "a name, a number, a string"]),
    ("dsl_rule_name_number.geom", "GO001", 3, 6, ["unexpected token '2'", "a name"]),
    ("dsl_missing_version.geom", "GO001", 1, 1, ["expected one of geomopt"]),
    ("dsl_yaml_given_to_dsl.geom", "GO001", 1, 8, ["unexpected token ':'", "an integer"]),
    # ---------------------------------------------------------------- positional arguments (GO005)
    ("dsl_positional_after_keyword.geom", "GO005", 4, 35, ["positional argument not allowed", "its reference, first"]),
    ("dsl_positional_in_direction.geom", "GO005", 5, 22, ["positional argument not allowed", "name=value"]),
    ("dsl_positional_in_constraint.geom", "GO005", 5, 31, ["positional argument not allowed"]),
    ("dsl_kind_keyword.geom", "GO005", 4, 34, ["write kind(…)"]),
    # ---------------------------------------------------------------- YAML features specs do not use (GO005)
    ("yaml_merge_key.yaml", "GO005", 10, 7, ["merge keys (<<) are not supported"]),
    ("yaml_recursive_alias.yaml", "GO005", 3, 8, ["recursive YAML alias"]),
    ("yaml_python_tag.yaml", "GO005", 6, 15, ["unsupported YAML tag !!python/object/apply:os.system"]),
    ("yaml_custom_tag.yaml", "GO005", 6, 15, ["unsupported YAML tag !spectral"]),
    ("yaml_explicit_bad_int.yaml", "GO005", 9, 44, ["'0b101' is not a valid !!int"]),
    ("yaml_complex_key.yaml", "GO005", 9, 7, ["mapping keys must be plain words"]),
    # ---------------------------------------------------------------- document shape, version (GO005, GO008)
    ("yaml_top_level_list.yaml", "GO005", 2, 1, ["a spec is a mapping", "not a list"]),
    ("yaml_top_level_scalar.yaml", "GO005", 1, 1, ["a spec is a mapping", "not a string"]),
    ("yaml_wrong_version.yaml", "GO008", 2, 10, ["version 2", "'geomopt: 1'"]),
    ("yaml_version_string.yaml", "GO008", 1, 10, ["version '1'"]),
    ("yaml_version_bool.yaml", "GO008", 1, 10, ["version true"]),
    ("dsl_wrong_version.geom", "GO008", 2, 9, ["version 2", "'geomopt 1'"]),
    # ---------------------------------------------------------------- missing required fields (GO006)
    ("yaml_missing_name.yaml", "GO006", 1, 1, ["missing required field 'name' in the spec"]),
    ("yaml_missing_version.yaml", "GO006", 1, 1, ["'geomopt'"]),
    ("yaml_missing_rules.yaml", "GO006", 1, 1, ["'rules'"]),
    ("yaml_missing_geometry.yaml", "GO006", 4, 5, ["'geometry' in rules[0]"]),
    ("yaml_missing_match.yaml", "GO006", 4, 5, ["'match' in rules[0]"]),
    ("yaml_missing_rule_name.yaml", "GO006", 4, 5, ["'name' in rules[0]"]),
    ("yaml_missing_reference.yaml", "GO006", 6, 5, ["'reference' in rules[0].geometry"]),
    ("yaml_missing_lam.yaml", "GO006", 9, 5, ["'lam' in rules[0].constraint"]),
    ("dsl_missing_name.geom", "GO006", 1, 1, ["'name'"]),
    ("dsl_missing_rules.geom", "GO006", 1, 1, ["'rules'"]),
    ("dsl_missing_geometry.geom", "GO006", 3, 1, ["'geometry' in rules[0]"]),
    ("dsl_missing_reference.geom", "GO006", 4, 5, ["'reference'"]),
    # ---------------------------------------------------------------- empty and unreadable (GO009, GO010)
    ("yaml_empty.yaml", "GO009", 1, 1, ["empty spec"]),
    ("yaml_whitespace_only.yaml", "GO009", 1, 1, ["empty spec"]),
    ("yaml_comments_only.yaml", "GO009", 1, 1, ["empty spec"]),
    ("dsl_empty.geom", "GO009", 1, 1, ["empty spec"]),
    ("dsl_whitespace_only.geom", "GO009", 1, 1, ["empty spec"]),
    ("dsl_comments_only.geom", "GO009", 1, 1, ["empty spec"]),
    ("yaml_binary_nul.yaml", "GO010", 2, 11, ["NUL byte"]),
    ("yaml_invalid_utf8.yaml", "GO010", 2, 8, ["not UTF-8"]),
    ("yaml_control_character.yaml", "GO010", 2, 9, ["#x0007"]),
    ("dsl_binary_nul.geom", "GO010", 3, 8, ["NUL byte"]),
    ("dsl_invalid_utf8.geom", "GO010", 1, 1, ["not UTF-8"]),
]


def _first(path: pathlib.Path):
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.load_spec(path)
    assert info.value.diagnostics, "SpecError without diagnostics"
    return info.value


@pytest.mark.parametrize("name, code, line, col, hints", CASES, ids=[c[0] for c in CASES])
def test_bad_spec(name, code, line, col, hints):
    path = HERE / name
    err = _first(path)
    d = err.diagnostics[0]
    assert (d.code, d.line, d.col) == (code, line, col), d.format()
    assert d.severity == "error"
    assert d.name == LANGUAGE_CODES[code][0]
    assert d.file == str(path)
    for hint in hints:
        assert hint in d.message, f"{hint!r} not in {d.message!r}"
    assert d.format().startswith(f"{path}:{line}:{col}: error {code} ")
    assert "Traceback" not in str(err) and "pydantic" not in d.message.lower() and "__ANON" not in d.message


def test_corpus_is_the_table():
    """Every file in bad_specs/ has a row, every row a file; both formats are covered."""
    files = sorted(p.name for p in HERE.iterdir())
    assert files == sorted(c[0] for c in CASES)
    assert sum(f.endswith(".yaml") for f in files) >= 20 and sum(f.endswith(".geom") for f in files) >= 20


@pytest.mark.parametrize("name, code, line, col, hints", CASES, ids=[c[0] for c in CASES])
def test_parse_spec_agrees_with_load_spec(name, code, line, col, hints):
    """parse_spec(text) reports the same first finding as load_spec(path) for decodable files."""
    raw = (HERE / name).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return  # only load_spec sees bytes; its row above covers it
    fmt = "yaml" if name.endswith(".yaml") else "dsl"
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec(text, fmt, file="x")
    d = info.value.diagnostics[0]
    assert (d.code, d.line, d.col, d.file) == (code, line, col, "x")


@pytest.mark.parametrize("suffix, fmt", [(".yaml", "yaml"), (".geom", "dsl")])
def test_huge_file(tmp_path, suffix, fmt):
    """A file over the size limit is refused up front (GO010), not parsed."""
    line = "# padding padding padding padding padding padding padding padding padding\n"
    text = ("geomopt: 1\n" if fmt == "yaml" else "geomopt 1\n") + line * (MAX_BYTES // len(line) + 10)
    assert len(text.encode()) > MAX_BYTES
    path = tmp_path / f"huge{suffix}"
    path.write_text(text)
    err = _first(path)
    d = err.diagnostics[0]
    assert (d.code, d.line, d.col) == ("GO010", 1, 1)
    assert "too large" in d.message and str(MAX_BYTES) in d.message
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec(text, fmt)
    assert info.value.diagnostics[0].code == "GO010"


@pytest.mark.parametrize("fmt, text", [
    ("yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    ("yaml", "a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n"),
    ("dsl", 'geomopt 1\nname "x"\nrule a match ndim=' + "[" * 5000 + "]" * 5000 + ":\n geometry euclidean\n"),
])
def test_deep_nesting_is_a_finding_not_a_recursion_error(fmt, text):
    with pytest.raises(geomopt.SpecError) as info:
        geomopt.parse_spec(text, fmt)
    d = info.value.diagnostics[0]
    assert d.code == "GO010" and "nested too deeply" in d.message and d.line >= 1 and d.col >= 1


def test_missing_file_and_unknown_extension(tmp_path):
    err = _first(tmp_path / "absent.yaml")
    assert err.diagnostics[0].code == "GO010"
    other = tmp_path / "spec.json"
    other.write_text("{}")
    err = _first(other)
    assert err.diagnostics[0].code == "GO010" and ".geom" in err.diagnostics[0].message
