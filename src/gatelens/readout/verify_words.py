"""What a verdict says in words: ``VerifyResult.explain`` and the sentences it is made of
(readout/verify.py holds the figures and the rule; docs/methods.md "Verification")."""

from __future__ import annotations

from gatelens.readout.verify_figures import hooks_sentence, maxes, passes

__all__ = ["VerdictWords"]


class VerdictWords:
    """``VerifyResult``'s words, from its figures (a mixin: every name it reads is one of
    ``VerifyResult``'s fields or properties)."""

    def explain(self) -> str:
        """What the figures say, in words (and, where float32 rounding at depth was
        re-judged in float64, that it was).

        >>> from gatelens.readout.verify import VerifyResult
        >>> v = VerifyResult("gru", [], 1e-13, None, None, 1e-6,
        ...                  meta={"float64_rejudge": {"float32_one_step": 2e-5}})
        >>> "float64" in v.explain()
        True
        """
        text = self._explain_figures()
        depth = self.meta.get("float64_rejudge")
        if depth and not self.nonfinite:
            now, where = self.judged_diff_h, ""
            if depth.get("layers") is not None:  # re-judged on the layers float32 rejected
                again = [r for r in self.layers if r.layer in depth["layers"]]
                scaled = maxes(again, "max_scaled_diff_h")
                now = maxes(again, "max_abs_diff_h") if scaled is None else scaled
                where = f" on layer{'s' * (len(depth['layers']) > 1)} " + ", ".join(
                    str(k) for k in depth["layers"])
            wins, on = depth.get("windows"), ""
            if wins:  # one window a chunk: where float32's figure was largest
                on = (f" on window{'s' * (len(wins) > 1)} {', '.join(map(str, wins))}, where "
                      "the float32 figure was largest (every other window's is at most that),")
            text += (f" In float32 the one-step error was {depth['float32_one_step']:.3g}, "
                     f"above {self.tol:g}{where}; against the module's own float64 forward"
                     f"{on} it is {now:.3g}"
                     ", so the float32 figure was "
                     + ("the module's rounding at this depth and width."
                        if self.passes_one_step else
                        "not rounding: the read-out differs from the module's computation."))
        return text

    def _explain_figures(self) -> str:
        """What the two figures say, in words.

        >>> from gatelens.readout.verify import VerifyResult
        >>> text = VerifyResult("gru", [], 1e-7, None, None, 1.9).explain()
        >>> "(passed)" in text and "chaotic" in text
        True
        """
        if self.nonfinite and self.meta.get("output_finite"):
            return ("the states read hold NaN or Inf on this text while the module's own "
                    "output is finite: a state outgrows the range of the dtype it is read in "
                    "(a memory kept on an exponential scale, e^m·C, once its stabiliser m "
                    "passes 709 in float64), so the read-out cannot be checked (FAILED).")
        if self.nonfinite:
            return ("the module's own states hold NaN or Inf on this text: its weights or its "
                    "input are not finite, so the read-out cannot be checked (FAILED).")
        if self.one_step_max_abs_diff_h is None:
            verdict = (f"free-running difference {self.max_abs_diff_h:.3g} "
                       f"{'<=' if self.passed else '>'} {self.tol:g} (packed input: the "
                       f"one-step check is not defined)")
            return verdict + (" (passed)." if self.passed else " (FAILED).")
        if self.one_step_max_scaled_diff_h is not None:
            return self._explain_modern()
        c = "" if self.max_scaled_diff_c is None else (
            f", c {self.max_scaled_diff_c:.3g} scaled by max(1, |c|)")
        ok = self.passes_one_step
        out = (f"one-step error {self.max_abs_diff_h:.3g}{c} {'<=' if ok else '>'} {self.tol:g}: "
               + ("each step is PyTorch's computation (passed)." if ok else
                  "the read-out does not compute PyTorch's cell (FAILED)."))
        fr = self.free_running_max_abs_diff_h
        if not ok:
            # a wrong read-out's re-run parts for that reason: never rounding, never chaos
            out += (f" Free-running divergence {fr:.3g}: not a property of the model here, as "
                    "the read-out's own step is wrong; it is no evidence of rounding or chaos.")
        elif fr > self.tol and not self.chaotic:
            out += (f" Free-running divergence {fr:.3g} is above the tolerance although the "
                    "model contracts on this text (its divergence rate λ < 0): rounding at "
                    f"{self.meta.get('dtype', 'this')} precision carried along the re-run, not "
                    "chaos and not an error.")
        elif self.chaotic:
            out += (f" Free-running divergence {fr:.3g}: the model is chaotic on this text, so "
                    "two correct implementations part after a few dozen steps; this is the "
                    "model's property, not an error, and the anchored read-out follows the "
                    "module's own trajectory.")
        else:
            out += (f" Free-running divergence {fr:.3g}: the step-by-step re-run stays on the "
                    "module's trajectory (contracting on this text).")
        out += hooks_sentence(self.meta)
        if not self.trace_passes:
            c = "" if self.trace_max_scaled_diff_c is None else (
                f", c {self.trace_max_scaled_diff_c:.3g} scaled by max(1, |c|)")
            out += (f" The trace given differs from the module's own states by h "
                    f"{self.trace_max_abs_diff_h:.3g}{c}: it is not the module's trajectory "
                    "(FAILED).")
        return out

    def _explain_modern(self) -> str:
        """explain() for gatelens's own cells, whose reference is their parallel form.

        >>> from gatelens.readout.verify import VerifyResult
        >>> r = VerifyResult("mingru", [], 7e-4, None, None, 2e-3,
        ...                  one_step_max_scaled_diff_h=3e-7)
        >>> r.explain().startswith("one-step error 3e-07 (h and y scaled")
        True
        """
        ok = self.passes_one_step
        out = (f"one-step error {self.one_step_max_scaled_diff_h:.3g} (h and y scaled by each "
               f"unit's largest |value| in the window, as they are unbounded; absolute "
               f"{self.max_abs_diff_h:.3g}) {'<=' if ok else '>'} {self.tol:g}: "
               + ("each layer's step computes the cell's parallel form (passed)." if ok else
                  "the step does not compute the cell's parallel form (FAILED)."))
        fr = self.free_running_max_abs_diff_h
        out += (f" Free-running difference {fr:.3g} (absolute) between the whole sequential "
                "stack and the parallel form: " + (
                    "rounding carried up through the layers, not an error by itself." if ok else
                    "not read, as the step itself is wrong; it is no evidence of rounding."))
        if self.trace_max_abs_diff_h is not None:
            ok = self.trace_passes
            out += (f" The trace given differs from the trajectory of the module's forward by "
                    f"{self._trace_h:.3g} scaled" + (
                        " (passed)." if passes(self._trace_h, None, self.tol) else
                        ", no more than the module's own float32 rounding of one step (passed)."
                        if ok else ": it is not the module's trajectory (FAILED)."))
        return out
