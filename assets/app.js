// Page-EntroKV app: the page's own script (app.py puts it in the page's head).
//
// 1. A slider's number box: Enter commits the typed value, as leaving the box does
//    (Gradio's box commits on blur only, so a value typed + Enter ran nothing and the
//    box showed a budget the results were not computed at).
// 2. Clicking into a number box runs nothing: Gradio's box sends a "release" on
//    pointerup, with the value it held before the typing (a budget of 10 typed after
//    a click ran the 100 the box held).
// 3. The presenter view (a class on the body, app.css) and, after a lesson is picked,
//    its chart scrolled into view under the lesson bar (fixed at the top there).
// 4. The link to the current settings (the "Link to these settings" button).
(() => {
  const isSliderBox = (t) =>
    t instanceof HTMLInputElement && t.type === "number" && t.dataset.testid === "number-input";
  document.addEventListener(
    "keydown",
    (e) => {
      if (e.key === "Enter" && isSliderBox(e.target)) {
        e.preventDefault();
        e.target.blur();
      }
    },
    true,
  );
  document.addEventListener(
    "pointerup",
    (e) => {
      if (isSliderBox(e.target)) e.stopPropagation();
    },
    true,
  );

  // Next / Previous pressed again before the lesson they asked for has loaded: each press
  // steps on from the lesson the press before asked for, not from the one still on the
  // screen. Every physical press is counted here, as it happens (a listener that runs
  // before Gradio's: Gradio may fold presses made while one is pending into one request,
  // and may run the event's own script only when it sends it); the request then sends
  // `from`, the lesson one step before the target, and the server steps from it.
  const step = (titles, from, delta) =>
    titles[(Math.max(0, titles.indexOf(from)) + delta + titles.length) % titles.length];
  document.addEventListener(
    "click",
    (e) => {
      const button = e.target.closest && e.target.closest("#next-lesson, #prev-lesson");
      const titles = window.pagekvTitles;
      if (!button || !titles) return;
      const delta = button.id === "next-lesson" ? 1 : -1;
      const shown = document.querySelector("#lesson-picker input");
      window.pagekvTarget = step(titles, window.pagekvTarget || (shown && shown.value), delta);
    },
    true,
  );
  window.pagekvStepFrom = (titles, delta, current) => {
    // No press counted (the listener missed it): step from the lesson on the screen.
    if (!window.pagekvTarget) window.pagekvTarget = step(titles, current, delta);
    return step(titles, window.pagekvTarget, -delta);
  };
  window.pagekvLanded = (title) => {
    if (!title || title === window.pagekvTarget) window.pagekvTarget = null;
  };
  // The fixed lesson bar's height changes with the width (its buttons wrap under the
  // picker on a narrow screen) and with the title: the lesson column starts below it.
  const padForBar = () => {
    const bar = document.querySelector("#lesson-picker");
    const on = document.body.classList.contains("pagekv-presenter");
    const height = on && bar ? Math.ceil(bar.getBoundingClientRect().height) + 8 : 0;
    document.body.style.setProperty("--pagekv-bar", `${height}px`);
  };
  window.addEventListener("resize", padForBar);
  window.pagekvPresenter = (on) => {
    document.body.classList.toggle("pagekv-presenter", Boolean(on));
    padForBar();
    const bar = document.querySelector("#lesson-picker");
    if (bar && !bar.pagekvWatched && window.ResizeObserver) {
      bar.pagekvWatched = true;
      new ResizeObserver(padForBar).observe(bar);
    }
    if (on) window.pagekvShowChart();
  };
  // After a lesson's request ends, Gradio still redraws its outputs (and the page
  // scrolls back while it does): the scroll waits until the page has settled.
  window.pagekvShowChart = () => {
    if (!document.body.classList.contains("pagekv-presenter")) return;
    let tries = 0;
    const place = () => {
      const views = document.querySelector("#lesson-views");
      const bar = document.querySelector("#lesson-picker");
      if (!views) return;
      const below = bar ? bar.getBoundingClientRect().height : 0;
      const top = views.getBoundingClientRect().top + window.scrollY - below - 8;
      window.scrollTo({ top: Math.max(0, top), behavior: "instant" });
      if (++tries < 6) setTimeout(place, 250);
    };
    setTimeout(place, 100);
  };
  // names: the run inputs in the order of the values; defaults: theirs. A value equal
  // to its default is left out of the link (the page fills it in).
  window.pagekvShareLink = (names, defaults, values) => {
    const q = new URLSearchParams();
    names.forEach((name, i) => {
      const v = values[i];
      if (v === null || v === undefined || v === "") return;
      if (String(v) === String(defaults[name])) return;
      q.set(name, String(v));
    });
    const query = q.toString();
    return location.origin + location.pathname + (query ? "?" + query : "?settings=default");
  };
})();
