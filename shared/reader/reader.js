// Open the collapsed sections (<details>) that hold the element the address's #anchor names.
function reveal() {
  var id = decodeURIComponent(location.hash.slice(1));
  var el = id && document.getElementById(id);
  if (!el) return;
  for (var p = el; p; p = p.parentElement) if (p.tagName === "DETAILS") p.open = true;
  el.scrollIntoView();
}
window.addEventListener("hashchange", reveal);
reveal();
