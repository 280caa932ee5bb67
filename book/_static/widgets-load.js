// Renders the run panels of a page (the ipywidgets state that execution saved) with require.js and
// html-manager, vendored in widgets/ at the book's root (book/_extra/widgets, see its README), and
// only on pages that hold widget state. Jupyter Book adds every .js file of _static to every page,
// so this small loader lives here and the 3.6 MB renderer does not. MyST-NB's own per-page scripts
// (nb_ipywidgets_js, off in _config.yml) would come from a CDN, and Sphinx 7 writes them into
// every later page too.
(function () {
  var root = document.currentScript.src.replace(/_static\/[^/]*$/, "");
  var here = root + "widgets/";
  // Where the widgets' icon font is: the modules bundled in embed-amd.js look in @jupyter-widgets/
  // beside the page (every page of this book sits at its root: book/_extra/@jupyter-widgets), and
  // html-manager itself looks here.
  window.__jupyter_widgets_assets_path__ = root + "@jupyter-widgets/";
  function add(name, then) {
    var s = document.createElement("script");
    s.src = here + name;
    s.onload = then;
    document.head.appendChild(s);
  }
  function start() {
    if (document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]')) {
      add("require.js", function () { add("embed-amd.js"); });
    }
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
