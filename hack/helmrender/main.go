// Command helmrender renders a Helm chart directory the way `helm template` does, for polyrl's
// tests (no helm binary can be had on the test machines). Built by hack/helmrender/prepare.sh from
// Debian sid's Go source packages.
//
// It is a re-implementation (not a copy) of the parts of Helm v3.21 that `helm template` uses for
// a chart without dependencies, following Helm's behaviour closely:
//
//   - the engine: one text/template set ("gotpl", missingkey=zero) holding every file under
//     templates/ (named "<chart>/templates/<path>"), sprig's TxtFuncMap minus env/expandenv, plus
//     Helm's include, tpl, required, fail, toYaml, toYamlPretty, fromYaml, fromYamlArray, toJson,
//     fromJson, fromJsonArray, toToml, fromToml, lookup (always an empty map, as in `helm
//     template`) and getHostByName (always ""); files whose base name starts with "_" only define
//     templates; "<no value>" is replaced by ""; error messages are cleaned up like Helm's
//     ("execution error at (<file>:<line>:<col>): <message of required/fail>");
//   - the root object: .Values, .Release (Name, Namespace, Service "Helm", IsInstall, IsUpgrade,
//     Revision 1), .Chart (Chart.yaml, Helm's field names), .Capabilities (KubeVersion,
//     APIVersions: the group versions of client-go 1.36's scheme + apiextensions, plus
//     --api-versions; HelmVersion), .Template (Name, BasePath), .Files, .Subcharts;
//   - values: values.yaml coalesced with the --values files (merged in order) and --set /
//     --set-string (Helm's strvals syntax: a.b=1,c[0].d=x,e={a,b}; a null removes a default);
//   - output: NOTES.txt left out (--notes prints it after a "NOTES:" line), each rendered file
//     split into YAML documents, empty ones dropped, manifests ordered by kind (Helm's install
//     order; stable, so by file path and position within a kind), hooks after them, each as
//     "---\n# Source: <chart>/templates/<file>\n<document>\n".
//
// Also like Helm: values.schema.json validation (santhosh-tekuri/jsonschema v6; local $refs only),
// .helmignore, Chart.yaml validation, the chart's kubeVersion constraint, release name validation.
//
// Not supported: subcharts/dependencies (refused), --set-json/--set-file/--set-literal,
// --output-dir, --post-renderer, --validate.
//
// Known differences: `typeOf .Values` says main.Values (Helm: chartutil.Values); sprig is Debian's
// 3.2.3 (Helm 3.21: 3.3.0, whose only addition, sha512sum, is added here); --debug prints the
// rendered files sorted by name (Helm: in map order).
package main

import (
	"bytes"
	"crypto/sha512"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/BurntSushi/toml"
	"github.com/Masterminds/semver/v3"
	"github.com/Masterminds/sprig/v3"
	"github.com/gobwas/glob"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"sigs.k8s.io/yaml"
	goYaml "sigs.k8s.io/yaml/goyaml.v3"
)

// buildInfo is set by prepare.sh (-X main.buildInfo=...): the Debian package versions used.
var buildInfo = "dev build"

const (
	// emulatedHelm is what .Capabilities.HelmVersion.Version reports.
	emulatedHelm       = "v3.21.4"
	defaultKubeVersion = "v1.36.0"
	notesSuffix        = "NOTES.txt"
	warnStart          = "HELM_ERR_START"
	warnEnd            = "HELM_ERR_END"
	maxIncludeDepth    = 1000
	maxSetIndex        = 65536
)

// builtinAPIVersions are the group versions Helm's default capabilities list for Kubernetes 1.36:
// every group version registered in client-go v0.36's kubernetes/scheme, plus
// apiextensions.k8s.io v1 and v1beta1 (Helm registers those too). Sorted; Helm's order is a Go
// map iteration order (random), only Has() is meant to be used.
var builtinAPIVersions = []string{
	"admissionregistration.k8s.io/v1", "admissionregistration.k8s.io/v1alpha1",
	"admissionregistration.k8s.io/v1beta1", "apiextensions.k8s.io/v1", "apiextensions.k8s.io/v1beta1",
	"apps/v1", "apps/v1beta1", "apps/v1beta2", "authentication.k8s.io/v1", "authentication.k8s.io/v1alpha1",
	"authentication.k8s.io/v1beta1", "authorization.k8s.io/v1", "authorization.k8s.io/v1beta1",
	"autoscaling/v1", "autoscaling/v2", "batch/v1", "batch/v1beta1", "certificates.k8s.io/v1",
	"certificates.k8s.io/v1alpha1", "certificates.k8s.io/v1beta1", "coordination.k8s.io/v1",
	"coordination.k8s.io/v1alpha2", "coordination.k8s.io/v1beta1", "discovery.k8s.io/v1",
	"discovery.k8s.io/v1beta1", "events.k8s.io/v1", "events.k8s.io/v1beta1", "extensions/v1beta1",
	"flowcontrol.apiserver.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1beta1",
	"flowcontrol.apiserver.k8s.io/v1beta2", "flowcontrol.apiserver.k8s.io/v1beta3",
	"internal.apiserver.k8s.io/v1alpha1", "networking.k8s.io/v1", "networking.k8s.io/v1beta1",
	"node.k8s.io/v1", "node.k8s.io/v1alpha1", "node.k8s.io/v1beta1", "policy/v1", "policy/v1beta1",
	"rbac.authorization.k8s.io/v1", "rbac.authorization.k8s.io/v1alpha1", "rbac.authorization.k8s.io/v1beta1",
	"resource.k8s.io/v1", "resource.k8s.io/v1alpha3", "resource.k8s.io/v1beta1", "resource.k8s.io/v1beta2",
	"scheduling.k8s.io/v1", "scheduling.k8s.io/v1alpha2", "scheduling.k8s.io/v1beta1", "storage.k8s.io/v1",
	"storage.k8s.io/v1alpha1", "storage.k8s.io/v1beta1", "storagemigration.k8s.io/v1beta1", "v1",
}

// installOrder is Helm's InstallOrder: manifests are sorted by kind in this order (stable);
// unknown kinds go last, alphabetically by kind.
var installOrder = []string{
	"PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
	"PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
	"PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole",
	"ClusterRoleList", "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding",
	"RoleBindingList", "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
	"HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService",
}

var hookEvents = map[string]bool{
	"pre-install": true, "post-install": true, "pre-delete": true, "post-delete": true,
	"pre-upgrade": true, "post-upgrade": true, "pre-rollback": true, "post-rollback": true,
	"test": true, "test-success": true,
}

// ---- chart model ----------------------------------------------------------------------------

// Maintainer, Dependency and Metadata carry Chart.yaml under Helm's (Go) field names.
type Maintainer struct {
	Name  string `json:"name,omitempty"`
	Email string `json:"email,omitempty"`
	URL   string `json:"url,omitempty"`
}

type Dependency struct {
	Name         string        `json:"name"`
	Version      string        `json:"version,omitempty"`
	Repository   string        `json:"repository"`
	Condition    string        `json:"condition,omitempty"`
	Tags         []string      `json:"tags,omitempty"`
	Enabled      bool          `json:"enabled,omitempty"`
	ImportValues []interface{} `json:"import-values,omitempty"`
	Alias        string        `json:"alias,omitempty"`
}

type Metadata struct {
	Name         string            `json:"name,omitempty"`
	Home         string            `json:"home,omitempty"`
	Sources      []string          `json:"sources,omitempty"`
	Version      string            `json:"version,omitempty"`
	Description  string            `json:"description,omitempty"`
	Keywords     []string          `json:"keywords,omitempty"`
	Maintainers  []*Maintainer     `json:"maintainers,omitempty"`
	Icon         string            `json:"icon,omitempty"`
	APIVersion   string            `json:"apiVersion,omitempty"`
	Condition    string            `json:"condition,omitempty"`
	Tags         string            `json:"tags,omitempty"`
	AppVersion   string            `json:"appVersion,omitempty"`
	Deprecated   bool              `json:"deprecated,omitempty"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	KubeVersion  string            `json:"kubeVersion,omitempty"`
	Dependencies []*Dependency     `json:"dependencies,omitempty"`
	Type         string            `json:"type,omitempty"`
}

// templateChart is what templates see as .Chart (Helm: the metadata plus IsRoot).
type templateChart struct {
	Metadata
	IsRoot bool
}

type chartFile struct {
	Name string // slash-separated, relative to the chart directory
	Data []byte
}

type chart struct {
	Metadata  Metadata
	Values    map[string]interface{}
	Schema    []byte // values.schema.json, if any
	Templates []chartFile
	Files     []chartFile // everything else that templates can read through .Files
}

// Values is the type of .Values and .Template (Helm's chartutil.Values), with its methods.
type Values map[string]interface{}

// YAML renders the values as YAML.
func (v Values) YAML() (string, error) {
	b, err := yaml.Marshal(v)
	return string(b), err
}

// AsMap returns the values as a plain map.
func (v Values) AsMap() map[string]interface{} {
	if len(v) == 0 {
		return map[string]interface{}{}
	}
	return v
}

// Table returns the nested table at a dotted path ("a.b").
func (v Values) Table(name string) (Values, error) {
	table := v
	for _, part := range strings.Split(name, ".") {
		next, ok := table[part].(map[string]interface{})
		if !ok {
			if vv, isValues := table[part].(Values); isValues {
				next, ok = vv, true
			}
		}
		if !ok {
			return Values{}, fmt.Errorf("no table named %q", name)
		}
		table = next
	}
	return table, nil
}

// KubeVersion, VersionSet, BuildInfo and Capabilities mirror Helm's .Capabilities.
type KubeVersion struct {
	Version string
	Major   string
	Minor   string
}

func (kv *KubeVersion) String() string { return kv.Version }

// GitVersion is the deprecated alias of Version.
func (kv *KubeVersion) GitVersion() string { return kv.Version }

type VersionSet []string

// Has reports whether the API version (e.g. "apps/v1") is in the set.
func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

type BuildInfo struct {
	Version      string `json:"version,omitempty"`
	GitCommit    string `json:"git_commit,omitempty"`
	GitTreeState string `json:"git_tree_state,omitempty"`
	GoVersion    string `json:"go_version,omitempty"`
}

type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion BuildInfo
}

// ---- .Files -----------------------------------------------------------------------------------

type files map[string][]byte

func newFiles(from []chartFile) files {
	f := files{}
	for _, cf := range from {
		f[cf.Name] = cf.Data
	}
	return f
}

// GetBytes returns a file's content (empty when missing).
func (f files) GetBytes(name string) []byte {
	if v, ok := f[name]; ok {
		return v
	}
	return []byte{}
}

// Get returns a file's content as a string (empty when missing).
func (f files) Get(name string) string { return string(f.GetBytes(name)) }

// Glob returns the files whose names match the pattern ('/' separated, ** allowed).
func (f files) Glob(pattern string) files {
	g, err := glob.Compile(pattern, '/')
	if err != nil {
		g, _ = glob.Compile("**")
	}
	out := files{}
	for name, data := range f {
		if g.Match(name) {
			out[name] = data
		}
	}
	return out
}

// AsConfig renders the files as a ConfigMap data map (base names as keys).
func (f files) AsConfig() string {
	if f == nil {
		return ""
	}
	m := map[string]string{}
	for k, v := range f {
		m[path.Base(k)] = string(v)
	}
	return toYAML(m)
}

// AsSecrets renders the files as a Secret data map (base64 values).
func (f files) AsSecrets() string {
	if f == nil {
		return ""
	}
	m := map[string]string{}
	for k, v := range f {
		m[path.Base(k)] = base64.StdEncoding.EncodeToString(v)
	}
	return toYAML(m)
}

// Lines splits a file into lines (without a trailing empty line).
func (f files) Lines(name string) []string {
	if f == nil || len(f[name]) == 0 {
		return []string{}
	}
	s := string(f[name])
	s = strings.TrimSuffix(s, "\n")
	return strings.Split(s, "\n")
}

// ---- loading a chart directory -----------------------------------------------------------------

// ignoreRule is one line of .helmignore (Helm's simplified .gitignore syntax, no "**").
type ignoreRule struct {
	pattern  string
	negate   bool
	dirOnly  bool
	anchored bool // leading "/": matched against the whole path
	hasSlash bool // matched against the whole path, else against the base name
}

func parseHelmignore(data string) ([]ignoreRule, error) {
	var rules []ignoreRule
	for _, line := range strings.Split(data, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.Contains(line, "**") {
			return nil, errors.New("double-star (**) syntax is not supported")
		}
		if _, err := filepath.Match(line, "abc"); err != nil {
			return nil, err
		}
		r := ignoreRule{}
		if strings.HasPrefix(line, "!") {
			r.negate = true
			line = line[1:]
		}
		if strings.HasSuffix(line, "/") {
			r.dirOnly = true
			line = strings.TrimSuffix(line, "/")
		}
		if strings.HasPrefix(line, "/") {
			r.anchored = true
			line = strings.TrimPrefix(line, "/")
		} else if strings.Contains(line, "/") {
			r.hasSlash = true
		}
		r.pattern = line
		rules = append(rules, r)
	}
	// Helm's default rule: hidden files in templates/ are never templates.
	rules = append(rules, ignoreRule{pattern: "templates/.?*", hasSlash: true})
	return rules, nil
}

func (r ignoreRule) matches(name string) bool {
	target := name
	if !r.anchored && !r.hasSlash {
		target = path.Base(name)
	}
	ok, err := filepath.Match(r.pattern, target)
	return err == nil && ok
}

func ignored(rules []ignoreRule, name string, isDir bool) bool {
	for _, r := range rules {
		if r.negate {
			if r.dirOnly && !isDir {
				return true
			}
			if !r.matches(name) {
				return true
			}
			continue
		}
		if r.dirOnly && !isDir {
			continue
		}
		if r.matches(name) {
			return true
		}
	}
	return false
}

// walkChart lists the chart's files (symlinks followed), relative slash paths, sorted.
func walkChart(root string, rules []ignoreRule) ([]chartFile, error) {
	var out []chartFile
	var walk func(dir, rel string) error
	walk = func(dir, rel string) error {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range entries { // ReadDir sorts by name
			full := filepath.Join(dir, e.Name())
			name := e.Name()
			if rel != "" {
				name = rel + "/" + e.Name()
			}
			fi, err := os.Stat(full)
			if err != nil {
				return err
			}
			if ignored(rules, name, fi.IsDir()) {
				continue
			}
			if fi.IsDir() {
				if err := walk(full, name); err != nil {
					return err
				}
				continue
			}
			if !fi.Mode().IsRegular() {
				return fmt.Errorf("cannot load irregular file %s as it has file mode type bits set", full)
			}
			data, err := os.ReadFile(full)
			if err != nil {
				return fmt.Errorf("error reading %s: %w", name, err)
			}
			out = append(out, chartFile{Name: name, Data: bytes.TrimPrefix(data, []byte("\xEF\xBB\xBF"))})
		}
		return nil
	}
	if err := walk(root, ""); err != nil {
		return nil, err
	}
	return out, nil
}

func loadChart(dir string) (*chart, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a chart directory (packaged charts are not supported)", dir)
	}
	var rules []ignoreRule
	if data, err := os.ReadFile(filepath.Join(dir, ".helmignore")); err == nil {
		if rules, err = parseHelmignore(string(data)); err != nil {
			return nil, fmt.Errorf("%s/.helmignore: %w", dir, err)
		}
	} else if rules, err = parseHelmignore(""); err != nil {
		return nil, err
	}
	all, err := walkChart(dir, rules)
	if err != nil {
		return nil, err
	}
	c := &chart{Values: map[string]interface{}{}}
	haveMeta := false
	for _, f := range all {
		switch {
		case f.Name == "Chart.yaml":
			if err := yaml.Unmarshal(f.Data, &c.Metadata); err != nil {
				return nil, fmt.Errorf("cannot load Chart.yaml: %w", err)
			}
			if c.Metadata.APIVersion == "" {
				c.Metadata.APIVersion = "v1"
			}
			haveMeta = true
		case f.Name == "values.yaml":
			vals := map[string]interface{}{}
			if err := yaml.Unmarshal(f.Data, &vals); err != nil {
				return nil, fmt.Errorf("cannot load values.yaml: %w", err)
			}
			if vals != nil {
				c.Values = vals
			}
		case f.Name == "values.schema.json":
			c.Schema = f.Data
		case f.Name == "Chart.lock", f.Name == "requirements.lock":
		case f.Name == "requirements.yaml":
			return nil, errors.New("helmrender: requirements.yaml (dependencies) is not supported")
		case strings.HasPrefix(f.Name, "templates/"):
			c.Templates = append(c.Templates, f)
		case strings.HasPrefix(f.Name, "charts/"):
			if filepath.Ext(f.Name) == ".prov" {
				c.Files = append(c.Files, f)
				continue
			}
			sub := strings.SplitN(strings.TrimPrefix(f.Name, "charts/"), "/", 2)[0]
			if strings.IndexAny(sub, "_.") == 0 {
				continue
			}
			return nil, fmt.Errorf("helmrender: subcharts are not supported (found %s)", f.Name)
		default:
			c.Files = append(c.Files, f)
		}
	}
	if !haveMeta {
		return nil, errors.New("Chart.yaml file is missing")
	}
	if err := validateMetadata(&c.Metadata); err != nil {
		return nil, err
	}
	if len(c.Metadata.Dependencies) > 0 {
		return nil, errors.New("helmrender: chart dependencies are not supported")
	}
	return c, nil
}

func validateMetadata(md *Metadata) error {
	switch {
	case md.APIVersion == "":
		return errors.New("validation: chart.metadata.apiVersion is required")
	case md.Name == "":
		return errors.New("validation: chart.metadata.name is required")
	case md.Name == "." || md.Name == "..":
		return fmt.Errorf("validation: chart.metadata.name %q is not allowed", md.Name)
	case md.Name != filepath.Base(md.Name):
		return fmt.Errorf("validation: chart.metadata.name %q is invalid", md.Name)
	case md.Version == "":
		return errors.New("validation: chart.metadata.version is required")
	}
	if _, err := semver.NewVersion(md.Version); err != nil {
		return fmt.Errorf("validation: chart.metadata.version %q is invalid", md.Version)
	}
	if md.Type != "" && md.Type != "application" && md.Type != "library" {
		return errors.New("validation: chart.metadata.type must be application or library")
	}
	return nil
}

// ---- values -------------------------------------------------------------------------------------

func deepCopy(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, x := range t {
			out[k] = deepCopy(x)
		}
		return out
	case []interface{}:
		out := make([]interface{}, len(t))
		for i, x := range t {
			out[i] = deepCopy(x)
		}
		return out
	default:
		return v
	}
}

func isTable(v interface{}) bool {
	_, ok := v.(map[string]interface{})
	return ok
}

// mergeMaps merges b over a, recursing into tables present in both (Helm: -f files in order).
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if bt, ok := v.(map[string]interface{}); ok {
			if at, ok := out[k].(map[string]interface{}); ok {
				out[k] = mergeMaps(at, bt)
				continue
			}
		}
		out[k] = v
	}
	return out
}

func warnf(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "warning: "+format+"\n", args...)
}

// coalesceValues puts the chart's defaults under the user-supplied values: the user's win, and a
// user null removes the default (Helm's chartutil.CoalesceValues for a chart without subcharts).
func coalesceValues(chartName string, defaults, user map[string]interface{}) map[string]interface{} {
	v, _ := deepCopy(user).(map[string]interface{})
	if v == nil {
		v = map[string]interface{}{}
	}
	d, _ := deepCopy(defaults).(map[string]interface{})
	for key, dv := range d {
		uv, ok := v[key]
		switch {
		case !ok:
			v[key] = dv
		case uv == nil:
			delete(v, key)
		case isTable(uv):
			if src, isMap := dv.(map[string]interface{}); isMap {
				coalesceTables(uv.(map[string]interface{}), src, chartName+"."+key)
			} else if dv != nil {
				warnf("skipped value for %s.%s: Not a table.", chartName, key)
			}
		}
	}
	return v
}

func coalesceTables(dst, src map[string]interface{}, prefix string) {
	srcNonNil := map[string]bool{}
	for k, val := range src {
		if val != nil {
			srcNonNil[k] = true
		}
	}
	for k, val := range dst {
		if val == nil {
			src[k] = nil
		}
	}
	for k, val := range src {
		full := prefix + "." + k
		dv, ok := dst[k]
		switch {
		case ok && dv == nil && srcNonNil[k]:
			delete(dst, k)
		case !ok:
			dst[k] = val
		case isTable(val):
			if isTable(dv) {
				coalesceTables(dv.(map[string]interface{}), val.(map[string]interface{}), full)
			} else {
				warnf("cannot overwrite table with non table for %s (%v)", full, val)
			}
		case isTable(dv) && val != nil:
			warnf("destination for %s is a table. Ignoring non-table value (%v)", full, val)
		}
	}
}

// setParser reads one --set / --set-string argument: comma-separated assignments
// `path=value`; a path is names separated by "." with list indexes "[n]"; a value is a scalar
// or a list `{a,b,c}`; a backslash escapes the next character. Scalars are typed like Helm's
// (true/false/null, integers not starting with 0) unless asString.
type setParser struct {
	s        []rune
	i        int
	asString bool
}

type pathPart struct {
	key   string
	index int // >= 0: a list index
}

func parseSet(arg string, dst map[string]interface{}, asString bool) error {
	p := &setParser{s: []rune(arg), asString: asString}
	for p.i < len(p.s) {
		if err := p.assignment(dst); err != nil {
			return err
		}
	}
	return nil
}

// readUntil returns the text up to (not including) the first unescaped rune of stops, and the
// stop rune (0 at the end of input).
func (p *setParser) readUntil(stops string) (string, rune) {
	var b strings.Builder
	for p.i < len(p.s) {
		r := p.s[p.i]
		if r == '\\' && p.i+1 < len(p.s) {
			b.WriteRune(p.s[p.i+1])
			p.i += 2
			continue
		}
		if strings.ContainsRune(stops, r) {
			p.i++
			return b.String(), r
		}
		b.WriteRune(r)
		p.i++
	}
	return b.String(), 0
}

func (p *setParser) assignment(dst map[string]interface{}) error {
	var parts []pathPart
	for {
		key, stop := p.readUntil(".[=,")
		if key != "" || stop != '[' || len(parts) == 0 {
			parts = append(parts, pathPart{key: key, index: -1})
		}
		for stop == '[' {
			num, end := p.readUntil("]")
			if end != ']' {
				return fmt.Errorf("key %q has an unterminated list index", key)
			}
			idx, err := strconv.Atoi(num)
			if err != nil || idx < 0 {
				return fmt.Errorf("failed to parse index %q of key %q", num, key)
			}
			if idx > maxSetIndex {
				return fmt.Errorf("index of %d is greater than maximum supported index %d", idx, maxSetIndex)
			}
			parts = append(parts, pathPart{index: idx})
			if p.i < len(p.s) && strings.ContainsRune(".[=,", p.s[p.i]) {
				stop = p.s[p.i]
				p.i++
			} else if p.i >= len(p.s) {
				stop = 0
			} else {
				return fmt.Errorf("unexpected %q after the index of key %q", p.s[p.i], key)
			}
		}
		switch stop {
		case '.':
			continue
		case '=':
		case ',':
			return fmt.Errorf("key %q has no value (cannot end with ,)", joinParts(parts))
		default:
			return fmt.Errorf("key %q has no value", joinParts(parts))
		}
		break
	}
	if parts[0].index >= 0 || parts[0].key == "" {
		return fmt.Errorf("key %q: a path must start with a name", joinParts(parts))
	}
	for _, part := range parts {
		if part.index < 0 && part.key == "" {
			return fmt.Errorf("key %q has an empty name", joinParts(parts))
		}
	}
	var value interface{}
	if p.i < len(p.s) && p.s[p.i] == '{' {
		p.i++
		list := []interface{}{}
		for {
			item, stop := p.readUntil(",}")
			if stop == 0 {
				return fmt.Errorf("list for key %q is not terminated by }", joinParts(parts))
			}
			if !(stop == '}' && item == "" && len(list) == 0) {
				list = append(list, p.typed(item))
			}
			if stop == '}' {
				break
			}
		}
		if p.i < len(p.s) {
			if p.s[p.i] != ',' {
				return fmt.Errorf("unexpected %q after the list of key %q", p.s[p.i], joinParts(parts))
			}
			p.i++
		}
		value = list
	} else {
		raw, _ := p.readUntil(",")
		value = p.typed(raw)
	}
	return setPath(dst, parts, value)
}

func joinParts(parts []pathPart) string {
	var b strings.Builder
	for i, part := range parts {
		if part.index >= 0 {
			fmt.Fprintf(&b, "[%d]", part.index)
			continue
		}
		if i > 0 {
			b.WriteByte('.')
		}
		b.WriteString(part.key)
	}
	return b.String()
}

func (p *setParser) typed(val string) interface{} {
	if p.asString {
		return val
	}
	switch {
	case strings.EqualFold(val, "true"):
		return true
	case strings.EqualFold(val, "false"):
		return false
	case strings.EqualFold(val, "null"):
		return nil
	case val == "0":
		return int64(0)
	}
	if val != "" && val[0] != '0' {
		if n, err := strconv.ParseInt(val, 10, 64); err == nil {
			return n
		}
	}
	return val
}

// setPath stores value at the path, creating (or replacing non-matching) tables and lists.
func setPath(m map[string]interface{}, parts []pathPart, value interface{}) error {
	cur := interface{}(m)
	var setCur func(interface{}) // writes a replacement for cur into its parent
	for n, part := range parts {
		last := n == len(parts)-1
		if part.index < 0 {
			table, ok := cur.(map[string]interface{})
			if !ok {
				table = map[string]interface{}{}
				setCur(table)
			}
			if last {
				table[part.key] = value
				return nil
			}
			key := part.key
			cur = table[key]
			setCur = func(v interface{}) { table[key] = v }
			continue
		}
		list, ok := cur.([]interface{})
		if !ok {
			list = []interface{}{}
		}
		for len(list) <= part.index {
			list = append(list, nil)
		}
		setCur(list)
		idx := part.index
		if last {
			list[idx] = value
			return nil
		}
		cur = list[idx]
		setCur = func(v interface{}) { list[idx] = v }
	}
	return nil
}

// validateValues checks the coalesced values against the chart's values.schema.json (JSON Schema,
// any draft the schema declares; $refs to local files only), as Helm does before rendering.
func validateValues(schemaJSON []byte, values map[string]interface{}) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("unable to validate schema: %s", r)
		}
	}()
	schema, err := jsonschema.UnmarshalJSON(bytes.NewReader(schemaJSON))
	if err != nil {
		return err
	}
	compiler := jsonschema.NewCompiler()
	compiler.UseLoader(jsonschema.SchemeURLLoader{"file": jsonschema.FileLoader{}})
	const url = "file:///values.schema.json"
	if err := compiler.AddResource(url, schema); err != nil {
		return err
	}
	validator, err := compiler.Compile(url)
	if err != nil {
		return err
	}
	if err := validator.Validate(values); err != nil {
		msg := strings.TrimPrefix(err.Error(), "jsonschema validation failed with '"+url+"#'\n")
		return errors.New(msg + "\n")
	}
	return nil
}

// ---- template functions --------------------------------------------------------------------------

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func toYAMLPretty(v interface{}) string {
	var data bytes.Buffer
	enc := goYaml.NewEncoder(&data)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	return strings.TrimSuffix(data.String(), "\n")
}

func fromYAML(str string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(str), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromYAMLArray(str string) []interface{} {
	a := []interface{}{}
	if err := yaml.Unmarshal([]byte(str), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func toTOML(v interface{}) string {
	b := bytes.NewBuffer(nil)
	if err := toml.NewEncoder(b).Encode(v); err != nil {
		return err.Error()
	}
	return b.String()
}

func fromTOML(str string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := toml.Unmarshal([]byte(str), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(str string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(str), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJSONArray(str string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(str), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func wrapWarning(msg string) string { return warnStart + msg + warnEnd }

// engine holds the template set and the include-depth counters shared by include and tpl.
type engine struct {
	depth map[string]int
}

func (e *engine) include(t *template.Template) func(string, interface{}) (string, error) {
	return func(name string, data interface{}) (string, error) {
		if e.depth[name] > maxIncludeDepth {
			return "", fmt.Errorf("rendering template has a nested reference name: %s: unable to execute template", name)
		}
		e.depth[name]++
		defer func() { e.depth[name]-- }()
		var buf strings.Builder
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
}

// tpl renders a string as a template, seeing every named template of its caller's set (and the
// ones the string defines itself), like Helm's tpl.
func (e *engine) tpl(parent *template.Template) func(string, interface{}) (string, error) {
	return func(text string, vals interface{}) (string, error) {
		t, err := parent.Clone()
		if err != nil {
			return "", fmt.Errorf("cannot clone template: %w", err)
		}
		t.Option("missingkey=zero") // Clone drops it (golang/go#43022)
		t.Funcs(template.FuncMap{"include": e.include(t), "tpl": e.tpl(t)})
		t, err = t.New(parent.Name()).Parse(text)
		if err != nil {
			return "", fmt.Errorf("cannot parse template %q: %w", text, err)
		}
		var buf strings.Builder
		if err := t.Execute(&buf, vals); err != nil {
			return "", fmt.Errorf("error during tpl function execution for %q: %w", text, err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
}

func (e *engine) funcMap(t *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	extra := template.FuncMap{
		"toToml":        toTOML,
		"fromToml":      fromTOML,
		"toYaml":        toYAML,
		"toYamlPretty":  toYAMLPretty,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"include":       e.include(t),
		"tpl":           e.tpl(t),
		"required": func(warn string, val interface{}) (interface{}, error) {
			if val == nil {
				return val, errors.New(wrapWarning(warn))
			}
			if s, ok := val.(string); ok && s == "" {
				return val, errors.New(wrapWarning(warn))
			}
			return val, nil
		},
		"fail": func(msg string) (string, error) {
			return "", errors.New(wrapWarning(msg))
		},
		// `helm template` has no cluster: lookup finds nothing, DNS lookups are disabled.
		"lookup": func(string, string, string, string) (map[string]interface{}, error) {
			return map[string]interface{}{}, nil
		},
		"getHostByName": func(string) string { return "" },
	}
	for k, v := range extra {
		f[k] = v
	}
	// Debian ships sprig 3.2.3 (already patched for camelcase); Helm 3.21 has 3.3.0, which adds
	// sha512sum.
	if _, ok := f["sha512sum"]; !ok {
		f["sha512sum"] = func(input string) string {
			sum := sha512.Sum512([]byte(input))
			return hex.EncodeToString(sum[:])
		}
	}
	return f
}

var warnRegex = regexp.MustCompile(warnStart + `((?s).*)` + warnEnd)

func cleanupParseError(filename string, err error) error {
	tokens := strings.Split(err.Error(), ": ")
	if len(tokens) == 1 {
		return fmt.Errorf("parse error in (%s): %s", filename, err)
	}
	return fmt.Errorf("parse error at (%s): %s", tokens[1], tokens[len(tokens)-1])
}

func cleanupExecError(filename string, err error) error {
	var execErr template.ExecError
	if !errors.As(err, &execErr) {
		return err
	}
	tokens := strings.SplitN(err.Error(), ": ", 3)
	if len(tokens) != 3 {
		return fmt.Errorf("execution error in (%s): %s", filename, err)
	}
	if parts := warnRegex.FindStringSubmatch(tokens[2]); len(parts) >= 2 {
		return fmt.Errorf("execution error at (%s): %s", tokens[1], parts[1])
	}
	return err
}

// templateOrder is Helm's parse/execute order: deeper paths first, then reverse lexical.
func templateOrder(names []string) []string {
	out := append([]string(nil), names...)
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		ca, cb := strings.Count(a, "/"), strings.Count(b, "/")
		if ca == cb {
			return a > b
		}
		return ca > cb
	})
	return out
}

// render executes every template; the result maps "<chart>/templates/<file>" to its output
// (partials left out).
func render(c *chart, top map[string]interface{}) (rendered map[string]string, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("rendering template failed: %v", r)
		}
	}()
	t := template.New("gotpl")
	t.Option("missingkey=zero")
	e := &engine{depth: map[string]int{}}
	t.Funcs(e.funcMap(t))

	sources := map[string]string{}
	var names []string
	for _, f := range c.Templates {
		name := path.Join(c.Metadata.Name, f.Name)
		sources[name] = string(f.Data)
		names = append(names, name)
	}
	keys := templateOrder(names)
	for _, name := range keys {
		if _, err := t.New(name).Parse(sources[name]); err != nil {
			return nil, cleanupParseError(name, err)
		}
	}
	rendered = map[string]string{}
	basePath := path.Join(c.Metadata.Name, "templates")
	for _, name := range keys {
		if strings.HasPrefix(path.Base(name), "_") {
			continue
		}
		top["Template"] = Values{"Name": name, "BasePath": basePath}
		var buf strings.Builder
		if err := t.ExecuteTemplate(&buf, name, top); err != nil {
			return nil, cleanupExecError(name, err)
		}
		rendered[name] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return rendered, nil
}

// ---- manifests ---------------------------------------------------------------------------------

var docSep = regexp.MustCompile(`(?:^|\s*\n)---\s*`)

// splitManifests splits a rendered file into its YAML documents (trimmed, empty ones dropped).
func splitManifests(big string) []string {
	var out []string
	for _, d := range docSep.Split(strings.TrimSpace(big), -1) {
		if d == "" {
			continue
		}
		out = append(out, strings.TrimSpace(d))
	}
	return out
}

type simpleHead struct {
	Version  string `json:"apiVersion"`
	Kind     string `json:"kind,omitempty"`
	Metadata *struct {
		Name        string            `json:"name"`
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata,omitempty"`
}

type manifest struct {
	Path    string
	Content string
	Kind    string
	Test    bool // a hook of event "test"
}

// sortManifests splits the rendered files (by sorted path) into documents, separates Helm hooks
// and orders both by kind (stable).
func sortManifests(files map[string]string) (generic, hooks []manifest, err error) {
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		content := files[p]
		if strings.HasPrefix(path.Base(p), "_") || strings.TrimSpace(content) == "" {
			continue
		}
		for _, doc := range splitManifests(content) {
			var head simpleHead
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				return nil, nil, fmt.Errorf("YAML parse error on %s: %w", p, err)
			}
			m := manifest{Path: p, Content: doc, Kind: head.Kind}
			hookTypes, isHook := "", false
			if head.Metadata != nil && len(head.Metadata.Annotations) > 0 {
				hookTypes, isHook = head.Metadata.Annotations["helm.sh/hook"]
			}
			if !isHook {
				generic = append(generic, m)
				continue
			}
			known := true
			for _, ev := range strings.Split(hookTypes, ",") {
				ev = strings.ToLower(strings.TrimSpace(ev))
				if !hookEvents[ev] {
					known = false
					break
				}
				if ev == "test" || ev == "test-success" {
					m.Test = true
				}
			}
			if !known {
				fmt.Fprintf(os.Stderr, "info: skipping unknown hook: %q\n", hookTypes)
				continue
			}
			hooks = append(hooks, m)
		}
	}
	byKind(generic)
	byKind(hooks)
	return generic, hooks, nil
}

func byKind(ms []manifest) {
	rank := map[string]int{}
	for i, k := range installOrder {
		rank[k] = i
	}
	sort.SliceStable(ms, func(i, j int) bool {
		a, aok := rank[ms[i].Kind]
		b, bok := rank[ms[j].Kind]
		switch {
		case !aok && !bok:
			return ms[i].Kind < ms[j].Kind
		case !aok:
			return false
		case !bok:
			return true
		}
		return a < b
	})
}

// ---- command line ------------------------------------------------------------------------------

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

var releaseNameRe = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

func parseKubeVersion(s string) (KubeVersion, error) {
	m := regexp.MustCompile(`^v?([0-9]+)\.([0-9]+)(?:\.([0-9]+))?(?:[-+].*)?$`).FindStringSubmatch(s)
	if m == nil {
		return KubeVersion{}, fmt.Errorf("invalid kube version '%s': could not parse %q as a version", s, s)
	}
	patch := m[3]
	if patch == "" {
		patch = "0"
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	p, _ := strconv.Atoi(patch)
	return KubeVersion{
		Version: fmt.Sprintf("v%d.%d.%d", major, minor, p),
		Major:   strconv.Itoa(major),
		Minor:   strconv.Itoa(minor),
	}, nil
}

type options struct {
	chart, release, namespace, kubeVersion string
	valueFiles, sets, setStrings           listFlag
	apiVersions, showOnly                  listFlag
	notes, includeCRDs, skipTests, noHooks bool
	isUpgrade, debug, skipSchema           bool
}

const usage = `usage: helmrender [flags] [NAME] [CHART]

Renders a Helm chart directory to stdout like 'helm template' (Helm v3.21 semantics).

flags:
  --chart DIR                the chart directory (or the last positional argument)
  -f, --values FILE          a values file, merged over values.yaml (repeatable, in order)
  --set a.b=v,c[0]=w,d={x,y} set values (repeatable; Helm's --set syntax and typing)
  --set-string a.b=v         like --set, every value a string
  --release-name NAME        .Release.Name (default "release-name"; or the first positional)
  -n, --namespace NS         .Release.Namespace (default "default")
  -a, --api-versions LIST    extra API versions for .Capabilities.APIVersions (comma-separated, repeatable)
  --kube-version V           .Capabilities.KubeVersion (default ` + defaultKubeVersion + `)
  --is-upgrade               .Release.IsUpgrade=true, IsInstall=false
  --skip-schema-validation   do not validate the values against values.schema.json
  --include-crds             print the chart's crds/ files first
  --no-hooks                 leave out manifests with a helm.sh/hook annotation
  --skip-tests               leave out test hooks
  -s, --show-only PATH       only the manifests of this template (e.g. templates/cm.yaml; repeatable)
  --notes                    print the rendered NOTES.txt after the manifests, after a "NOTES:" line
  --debug                    on a YAML error, still print the rendered files
  --version                  print the build information
`

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "Error: %s\n", err)
		var ue usageError
		if errors.As(err, &ue) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

type usageError struct{ msg string }

func (u usageError) Error() string { return u.msg }

func run(args []string, out io.Writer) error {
	var o options
	fs := flag.NewFlagSet("helmrender", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.chart, "chart", "", "")
	fs.Var(&o.valueFiles, "values", "")
	fs.Var(&o.valueFiles, "f", "")
	fs.Var(&o.sets, "set", "")
	fs.Var(&o.setStrings, "set-string", "")
	fs.StringVar(&o.release, "release-name", "", "")
	fs.StringVar(&o.namespace, "namespace", "default", "")
	fs.StringVar(&o.namespace, "n", "default", "")
	fs.Var(&o.apiVersions, "api-versions", "")
	fs.Var(&o.apiVersions, "a", "")
	fs.StringVar(&o.kubeVersion, "kube-version", defaultKubeVersion, "")
	fs.BoolVar(&o.isUpgrade, "is-upgrade", false, "")
	fs.BoolVar(&o.skipSchema, "skip-schema-validation", false, "")
	fs.BoolVar(&o.includeCRDs, "include-crds", false, "")
	fs.BoolVar(&o.noHooks, "no-hooks", false, "")
	fs.BoolVar(&o.skipTests, "skip-tests", false, "")
	fs.Var(&o.showOnly, "show-only", "")
	fs.Var(&o.showOnly, "s", "")
	fs.BoolVar(&o.notes, "notes", false, "")
	fs.BoolVar(&o.debug, "debug", false, "")
	version := fs.Bool("version", false, "")
	help := fs.Bool("help", false, "")
	fs.BoolVar(help, "h", false, "")
	// Flags and positional arguments may be interspersed (as with helm's pflag).
	var pos []string
	for rest := args; ; {
		if err := fs.Parse(rest); err != nil {
			return usageError{err.Error() + "\n\n" + usage}
		}
		rest = fs.Args()
		if len(rest) == 0 {
			break
		}
		pos, rest = append(pos, rest[0]), rest[1:]
	}
	if *help {
		fmt.Fprint(out, usage)
		return nil
	}
	if *version {
		fmt.Fprintf(out, "helmrender (Helm %s template semantics; %s)\n", emulatedHelm, buildInfo)
		return nil
	}
	switch {
	case len(pos) == 2 && o.chart == "" && o.release == "":
		o.release, o.chart = pos[0], pos[1]
	case len(pos) == 1 && o.chart == "":
		o.chart = pos[0]
	case len(pos) == 1 && o.release == "":
		o.release = pos[0]
	case len(pos) > 0:
		return usageError{fmt.Sprintf("unexpected arguments %q\n\n%s", pos, usage)}
	}
	if o.chart == "" {
		return usageError{"no chart given (--chart DIR)\n\n" + usage}
	}
	if o.release == "" {
		o.release = "release-name"
	}
	return renderChart(o, out)
}

func renderChart(o options, out io.Writer) error {
	if len(o.release) > 53 || !releaseNameRe.MatchString(o.release) {
		return fmt.Errorf("release name %q: invalid release name, must match regex %s and the length must not be longer than 53", o.release, releaseNameRe)
	}
	kv, err := parseKubeVersion(o.kubeVersion)
	if err != nil {
		return err
	}
	c, err := loadChart(o.chart)
	if err != nil {
		return err
	}
	if c.Metadata.Type == "library" {
		return errors.New("library charts are not installable")
	}

	user := map[string]interface{}{}
	for _, file := range o.valueFiles {
		data, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		cur := map[string]interface{}{}
		if err := yaml.Unmarshal(data, &cur); err != nil {
			return fmt.Errorf("failed to parse %s: %w", file, err)
		}
		user = mergeMaps(user, cur)
	}
	for _, s := range o.sets {
		if err := parseSet(s, user, false); err != nil {
			return fmt.Errorf("failed parsing --set data: %w", err)
		}
	}
	for _, s := range o.setStrings {
		if err := parseSet(s, user, true); err != nil {
			return fmt.Errorf("failed parsing --set-string data: %w", err)
		}
	}
	vals := coalesceValues(c.Metadata.Name, c.Values, user)
	if c.Schema != nil && !o.skipSchema {
		if err := validateValues(c.Schema, vals); err != nil {
			return fmt.Errorf("values don't meet the specifications of the schema(s) in the following chart(s):\n%s:\n%s", c.Metadata.Name, err)
		}
	}
	if c.Metadata.KubeVersion != "" {
		v, verr := semver.NewVersion(kv.Version)
		cons, cerr := semver.NewConstraint(c.Metadata.KubeVersion)
		if verr != nil || cerr != nil || !cons.Check(v) {
			return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s", c.Metadata.KubeVersion, kv.Version)
		}
	}

	apis := append(VersionSet(nil), builtinAPIVersions...)
	for _, a := range o.apiVersions {
		for _, v := range strings.Split(a, ",") {
			if v = strings.TrimSpace(v); v != "" {
				apis = append(apis, v)
			}
		}
	}
	top := map[string]interface{}{
		"Values": Values(vals),
		"Release": map[string]interface{}{
			"Name":      o.release,
			"Namespace": o.namespace,
			"IsUpgrade": o.isUpgrade,
			"IsInstall": !o.isUpgrade,
			"Revision":  1,
			"Service":   "Helm",
		},
		"Chart": templateChart{Metadata: c.Metadata, IsRoot: true},
		"Capabilities": &Capabilities{
			KubeVersion: kv,
			APIVersions: apis,
			HelmVersion: BuildInfo{Version: emulatedHelm, GitCommit: "helmrender", GitTreeState: "clean", GoVersion: runtime.Version()},
		},
		"Files":     newFiles(c.Files),
		"Subcharts": map[string]interface{}{},
	}

	rendered, err := render(c, top)
	if err != nil {
		return err
	}
	notes := ""
	for name, text := range rendered {
		if strings.HasSuffix(name, notesSuffix) {
			if name == path.Join(c.Metadata.Name, "templates", notesSuffix) {
				notes = text
			}
			delete(rendered, name)
		}
	}

	var b strings.Builder
	generic, hooks, err := sortManifests(rendered)
	if err != nil {
		if o.debug {
			names := make([]string, 0, len(rendered))
			for name := range rendered {
				names = append(names, name)
			}
			sort.Strings(names)
			for _, name := range names {
				if strings.TrimSpace(rendered[name]) != "" {
					fmt.Fprintf(out, "---\n# Source: %s\n%s\n", name, rendered[name])
				}
			}
			return err
		}
		return fmt.Errorf("%w\n\nUse --debug flag to render out invalid YAML", err)
	}
	if o.includeCRDs {
		for _, f := range c.Files {
			ext := strings.ToLower(path.Ext(f.Name))
			if strings.HasPrefix(f.Name, "crds/") && (ext == ".yaml" || ext == ".yml" || ext == ".json") {
				fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", path.Join(c.Metadata.Name, f.Name), f.Data)
			}
		}
	}
	for _, m := range generic {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", m.Path, m.Content)
	}
	var result strings.Builder
	fmt.Fprintln(&result, strings.TrimSpace(b.String()))
	if !o.noHooks {
		for _, m := range hooks {
			if o.skipTests && m.Test {
				continue
			}
			fmt.Fprintf(&result, "---\n# Source: %s\n%s\n", m.Path, m.Content)
		}
	}

	text := result.String()
	if len(o.showOnly) > 0 {
		text, err = showOnly(text, o.showOnly)
		if err != nil {
			return err
		}
	}
	if _, err := io.WriteString(out, text); err != nil {
		return err
	}
	if o.notes && notes != "" {
		fmt.Fprintf(out, "NOTES:\n%s\n", strings.TrimSpace(notes))
	}
	return nil
}

var sourceRe = regexp.MustCompile("# Source: [^/]+/(.+)")

func showOnly(text string, patterns []string) (string, error) {
	docs := splitManifests(text)
	var b strings.Builder
	for _, pattern := range patterns {
		pattern = filepath.ToSlash(pattern)
		found := false
		for _, doc := range docs {
			m := sourceRe.FindStringSubmatch(doc)
			if m == nil {
				continue
			}
			if ok, _ := filepath.Match(pattern, m[1]); ok {
				fmt.Fprintf(&b, "---\n%s\n", doc)
				found = true
			}
		}
		if !found {
			return "", fmt.Errorf("could not find template %s in chart", pattern)
		}
	}
	return b.String(), nil
}
