// helmrender renders a Helm chart the way `helm template` does, for machines without helm: Go's
// text/template with the sprig functions and Helm's own additions that charts/hora uses (include,
// tpl, required, toYaml, fromYaml, toJson), .Values merged from values.yaml and -f files, .Release
// and .Chart. It renders every template under templates/ (files starting with "_" only define
// named templates) and prints them as one YAML stream with "# Source:" headers, as helm does.
//
// Usage: helmrender CHART_DIR RELEASE NAMESPACE [VALUES_FILE...]
// Build (offline, Debian packages golang-go and golang-github-masterminds-sprig-dev):
//   GO111MODULE=off GOPATH=/usr/share/gocode go build -o helmrender main.go
package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	yaml "gopkg.in/yaml.v3"
)

func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	return out, nil
}

// merge overlays src on dst: maps merge key by key, anything else is replaced, and a null removes
// the key (Helm's coalescing of user values over the chart's).
func merge(dst, src map[string]interface{}) map[string]interface{} {
	for key, value := range src {
		if value == nil {
			delete(dst, key)
			continue
		}
		if sub, ok := value.(map[string]interface{}); ok {
			if have, ok := dst[key].(map[string]interface{}); ok {
				dst[key] = merge(have, sub)
				continue
			}
		}
		dst[key] = value
	}
	return dst
}

func toYAML(v interface{}) string {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

func fromYAML(s string) map[string]interface{} {
	out := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &out); err != nil {
		out["Error"] = err.Error()
	}
	return out
}

func required(msg string, v interface{}) (interface{}, error) {
	if v == nil {
		return v, fmt.Errorf(msg)
	}
	if s, ok := v.(string); ok && s == "" {
		return v, fmt.Errorf(msg)
	}
	return v, nil
}

func main() {
	if len(os.Args) < 4 {
		fmt.Fprintln(os.Stderr, "usage: helmrender CHART_DIR RELEASE NAMESPACE [VALUES_FILE...]")
		os.Exit(2)
	}
	chartDir, release, namespace := os.Args[1], os.Args[2], os.Args[3]
	chart, err := readYAML(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		fail(err)
	}
	values, err := readYAML(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		fail(err)
	}
	for _, path := range os.Args[4:] {
		extra, err := readYAML(path)
		if err != nil {
			fail(err)
		}
		values = merge(values, extra)
	}
	name, _ := chart["name"].(string)
	top := map[string]interface{}{
		"Values":  values,
		"Release": map[string]interface{}{"Name": release, "Namespace": namespace, "Service": "Helm", "IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Chart":   map[string]interface{}{"Name": name, "Version": chart["version"], "AppVersion": chart["appVersion"]},
	}

	root := template.New("root")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env") // Helm removes these two: a chart must not read the renderer's environment
	delete(funcs, "expandenv")
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = fromYAML
	funcs["required"] = required
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var buf bytes.Buffer
		err := root.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = t.Execute(&buf, data)
		return buf.String(), err
	}
	root.Funcs(funcs).Option("missingkey=zero")

	templatesDir := filepath.Join(chartDir, "templates")
	entries, err := os.ReadDir(templatesDir)
	if err != nil {
		fail(err)
	}
	var names []string
	for _, entry := range entries {
		if entry.IsDir() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(templatesDir, entry.Name()))
		if err != nil {
			fail(err)
		}
		full := name + "/templates/" + entry.Name()
		if _, err := root.New(full).Parse(string(data)); err != nil {
			fail(err)
		}
		names = append(names, full)
	}
	sort.Strings(names)
	var out bytes.Buffer
	for _, full := range names {
		base := filepath.Base(full)
		if strings.HasPrefix(base, "_") {
			continue
		}
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, full, top); err != nil {
			fail(err)
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if strings.TrimSpace(text) == "" {
			continue
		}
		if base == "NOTES.txt" {
			fmt.Fprintf(os.Stderr, "NOTES:\n%s\n", text)
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", full, strings.TrimSpace(text))
	}
	os.Stdout.Write(out.Bytes())
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "Error: %v\n", err)
	os.Exit(1)
}
