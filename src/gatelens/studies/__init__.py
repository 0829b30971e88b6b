"""Many runs, one finding: study specs, trials on Ray, the merge, and the seed's reproduction."""
