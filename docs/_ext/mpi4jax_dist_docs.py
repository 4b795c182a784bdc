"""Sphinx directives that render what the code says, so the pages cannot drift.

``.. mpi4jax-dist-launchers::``
    The launchers recognised by their variables, from
    ``mpi4jax_dist.launch.detect.LAUNCHERS`` (most specific first).
``.. mpi4jax-dist-cli-help::``
    ``python -m mpi4jax_dist --help``, from the parser itself.
"""

from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _rst_table(header: list[str], rows: list[list[str]], widths: str) -> list[str]:
    """A list-table: cells may hold inline markup and run to several lines."""
    lines = [".. list-table::", "   :header-rows: 1", f"   :widths: {widths}", ""]
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            prefix = "   * - " if i == 0 else "     - "
            lines.append(prefix + (cell or " "))
    return lines


class Launchers(SphinxDirective):
    """The launchers and the variables that recognise them."""

    def run(self):
        from mpi4jax_dist.launch import detect

        def names(variables):
            return ", ".join(f"``{n}``" for n in variables)

        rows = [
            [
                f"``{launcher.name}``",
                names(launcher.markers),
                names(launcher.require) or "",
                f"``{launcher.size}``" if launcher.size else "",
            ]
            for launcher in detect.LAUNCHERS
        ]
        header = ["name", "any of", "and all of", "process count"]
        return _parsed(self, _rst_table(header, rows, "20 35 25 20"), "LAUNCHERS")


def _parsed(directive: SphinxDirective, lines: list[str], source: str):
    node = nodes.container()
    directive.state.nested_parse(StringList(lines, source=source), 0, node)
    return node.children


class CliHelp(SphinxDirective):
    """``python -m mpi4jax_dist --help`` as the parser prints it."""

    def run(self):
        from mpi4jax_dist.diagnostics.cli import parser

        text = parser().format_help()
        return [nodes.literal_block(text, text)]


def setup(app):
    app.add_directive("mpi4jax-dist-launchers", Launchers)
    app.add_directive("mpi4jax-dist-cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
