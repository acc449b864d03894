"""The stream figure (harness.analysis.stream): NLL along a stream through re-positioned windows beside dense
attention, from text_positions rows."""

import pandas as pd
import pytest

from harness.analysis import figures, stream


def rows(label, nll, nll_fp32, positions=range(256), texts=2, status="ok", model="mini-llama"):
    return pd.DataFrame([dict(run_name=label, status=status, model=model, cache="window", cache_label=label,
                              dtype="fp32", text=t, text_id=f"t{t}", position=p, nll=nll(p), nll_fp32=nll_fp32(p))
                         for t in range(texts) for p in positions])


def test_stream_curves_pool_each_bucket_per_series_and_count_dense_tokens_once():
    df = pd.concat([rows("window S0+W32 @cache", lambda p: 5.0 if p >= 128 else 3.0, lambda p: 3.0 + p / 256),
                    rows("window S1+W32 @cache", lambda p: 3.0, lambda p: 3.0 + p / 256),
                    rows("window S4+W32", lambda p: 9.0, lambda p: 0.0),  # absolute positions: not a stream
                    rows("window S2+W32 @cache", lambda p: 9.0, lambda p: 0.0, status="failed")])
    curves = stream.stream_curves(df)
    assert set(curves["series"]) == {stream.DENSE, "window S0+W32 @cache", "window S1+W32 @cache"}
    s0 = curves[curves["series"] == "window S0+W32 @cache"].set_index("position")
    assert s0.loc[0, "nll"] == 3.0 and s0.loc[128, "nll"] == 5.0 and s0.loc[0, "tokens"] == 2 * 128
    dense = curves[curves["series"] == stream.DENSE].set_index("position")
    assert dense.loc[0, "tokens"] == 2 * 128  # two runs scored the same texts: each token once
    assert dense.loc[128, "nll"] == pytest.approx(3.0 + (128 + 255) / 2 / 256)
    assert stream.streamed(df) and not stream.streamed(df[~df["cache_label"].str.endswith("@cache")])


def test_the_stream_figure_is_drawn_only_for_re_positioned_windows():
    fig = next(f for f in figures.FIGURES if f.stem == "stream")
    assert fig.table == "text_positions" and fig.when is stream.streamed
    drawn = stream.stream_plot(rows("window S1+W32 @cache", lambda p: 3.0, lambda p: 3.0))
    assert len(drawn.axes) == 1 and {t.get_text() for t in drawn.axes[0].get_legend().get_texts()} == {
        stream.DENSE, "window S1+W32 @cache"}
